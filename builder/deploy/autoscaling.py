"""Autoscaling on LLM load: waiting requests per replica and KV-cache fraction, never CPU.

CPU use says nothing about an LLM server (a decoding engine is busy at any load; a GPU engine
barely uses the CPU). The two signals that do are the contract's metrics on port 8002:
`nv_trt_llm_request_metrics{request_type="waiting"}` (requests queued, not yet running) and
`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}` (KV blocks used / max).

- `keda` (default): a ScaledObject with two Prometheus triggers; each query sums the metric over
  the Service's pods and KEDA divides by the replicas (AverageValue), so the threshold is per
  replica. Everything is in the manifest.
- `hpa`: an autoscaling/v2 HorizontalPodAutoscaler on two Pods metrics served by the Prometheus
  adapter; `adapter_rules` is the adapter's rule for them (its Helm values `rules.custom`),
  written beside the manifests for whoever runs the adapter.
Both scale down slowly (5 min window): every new replica pays an engine load.
"""
from __future__ import annotations

from builder.deploy.context import DeployContext

WAITING_METRIC = "llm_forge_waiting_requests"       # names the adapter serves the HPA
KV_FRACTION_METRIC = "llm_forge_kv_cache_fraction"
SCALE_DOWN_WINDOW_SECONDS = 300
_BEHAVIOR = {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_SECONDS,
                           "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a target: 4 -> "4", 0.8 -> "800m"."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def horizontal_pod_autoscaler(ctx: DeployContext) -> dict:
    a = ctx.deployment.autoscaling

    def pods_metric(name: str, target: float) -> dict:
        return {"type": "Pods", "pods": {"metric": {"name": name}, "target": {
            "type": "AverageValue", "averageValue": _quantity(target)}}}

    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": ctx.metadata(),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": ctx.name},
                     "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
                     "metrics": [pods_metric(WAITING_METRIC, a.queue_depth_target),
                                 pods_metric(KV_FRACTION_METRIC, a.kv_cache_fraction_target)],
                     "behavior": _BEHAVIOR}}


def adapter_rules() -> dict:
    """Prometheus-adapter rules serving the two Pods metrics the HPA reads."""
    resources = {"overrides": {"namespace": {"resource": "namespace"},
                               "pod": {"resource": "pod"}}}

    def rule(metric: str, label: str, value: str, name: str, aggregate: str) -> dict:
        return {"seriesQuery": f'{metric}{{{label}="{value}",namespace!="",pod!=""}}',
                "resources": resources,
                "name": {"matches": f"^{metric}$", "as": name},
                "metricsQuery": f'{aggregate}(<<.Series>>{{<<.LabelMatchers>>,{label}="{value}"}})'
                                " by (<<.GroupBy>>)"}

    return {"rules": {"custom": [
        rule("nv_trt_llm_request_metrics", "request_type", "waiting", WAITING_METRIC, "sum"),
        rule("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "fraction",
             KV_FRACTION_METRIC, "max"),
    ]}}


def scaled_object(ctx: DeployContext) -> dict:
    a = ctx.deployment.autoscaling
    # The ServiceMonitor's scrape gives every series the Service's namespace and name.
    where = f'namespace="{ctx.namespace}",service="{ctx.name}"'

    def trigger(name: str, query: str, threshold: float) -> dict:
        return {"type": "prometheus", "name": name, "metricType": "AverageValue",
                "metadata": {"serverAddress": a.prometheus_url, "query": query,
                             "threshold": f"{threshold:g}"}}

    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": ctx.metadata(),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": ctx.name},
                     "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
                     "pollingInterval": 15,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _BEHAVIOR}},
                     "triggers": [
                         trigger("queue-depth", "sum(nv_trt_llm_request_metrics{"
                                 f'{where},request_type="waiting"}})', a.queue_depth_target),
                         trigger("kv-cache-fraction", "sum(nv_trt_llm_kv_cache_block_metrics{"
                                 f'{where},kv_cache_block_type="fraction"}})',
                                 a.kv_cache_fraction_target)]}}

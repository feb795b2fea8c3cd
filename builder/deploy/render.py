"""All of a deployment's objects, rendered into plain YAML files and a kustomization.yaml.

One file per concern, each a list of objects (`---` separated); `kustomization.yaml` lists
them and sets the namespace. `prometheus-adapter-rules.yaml` (HPA only) is not a Kubernetes
object: it is the Prometheus adapter's rule for the HPA's metrics, for whoever runs the adapter,
and stays out of the kustomization.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from builder.deploy import autoscaling, epp, gateway, monitoring, network, workload
from builder.deploy.context import DeployContext

ADAPTER_RULES_FILE = "prometheus-adapter-rules.yaml"
AUTOSCALER_FILES = ("hpa.yaml", "scaledobject.yaml")


def render_objects(ctx: DeployContext) -> dict[str, list[dict]]:
    """File name -> the Kubernetes objects it holds, in the order they are applied."""
    files: dict[str, list[dict]] = {
        "deployment.yaml": [workload.deployment(ctx)],
        "service.yaml": [network.service(ctx)],
        "pdb.yaml": [network.disruption_budget(ctx)],
        "networkpolicy.yaml": [network.network_policy(ctx), network.epp_network_policy(ctx)],
        "servicemonitor.yaml": [monitoring.service_monitor(ctx)],
        "inferencepool.yaml": [gateway.inference_pool(ctx)],
        "epp.yaml": [*epp.epp_rbac(ctx), epp.config_map(ctx), epp.epp_deployment(ctx),
                     epp.epp_service(ctx)],
    }
    kind = ctx.deployment.autoscaling.kind
    if kind == "hpa":
        files["hpa.yaml"] = [autoscaling.horizontal_pod_autoscaler(ctx)]
    elif kind == "keda":
        files["scaledobject.yaml"] = [autoscaling.scaled_object(ctx)]
    return files


def kustomization(ctx: DeployContext, files: list[str]) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": ctx.namespace, "resources": files}


def write_manifests(ctx: DeployContext, out_dir: str | Path) -> list[Path]:
    """Render a deployment (`context.deploy_context(spec)`) into `out_dir`; returns the files
    written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    objects = render_objects(ctx)
    written = []
    for name, docs in objects.items():
        path = out / name
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        written.append(path)
    path = out / "kustomization.yaml"
    path.write_text(yaml.safe_dump(kustomization(ctx, list(objects)), sort_keys=False))
    written.append(path)
    rules = out / ADAPTER_RULES_FILE
    if ctx.deployment.autoscaling.kind == "hpa":
        rules.write_text("# Prometheus adapter rules (Helm values) serving the HPA's metrics\n"
                         + yaml.safe_dump(autoscaling.adapter_rules(), sort_keys=False))
        written.append(rules)
    # A render with another autoscaler leaves no file of the previous one behind.
    for name in (*AUTOSCALER_FILES, ADAPTER_RULES_FILE):
        if out.joinpath(name) not in written and out.joinpath(name).exists():
            out.joinpath(name).unlink()
    return written

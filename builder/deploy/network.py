"""Service, PodDisruptionBudget and NetworkPolicy of the model-server pods.

Who may reach which port (the NetworkPolicy admits nothing else; `policyTypes: [Ingress]`):
- OpenAI API (8080): the gateway namespace and the spec's `client_namespaces`. Every request
  needs the API key besides.
- Triton HTTP/gRPC (8000/8001): no key, so bound to 127.0.0.1 by default and not in the policy;
  with `triton_ports: gateway` (and always under MPI, tp * pp > 1) bound to 0.0.0.0 and admitted
  from the gateway namespace only (under MPI the probes on Triton's HTTP port are exec probes,
  asked from inside the container: `server.probes`).
- Metrics (8002): the monitoring namespace (Prometheus), the gateway namespace and the endpoint
  picker's pods (it scrapes queue depth and KV use to route). Read-only numbers, no inference.
- Health (8003): from anywhere. The kubelet probes from the node, which a NetworkPolicy cannot
  name portably (CNIs differ on node traffic); the port answers status JSON only, and its one
  write (`POST /drain`) refuses any client but loopback.
The endpoint picker's own policy admits ext-proc (9002) from the gateway namespace, its metrics
(9090) from the monitoring namespace, and its gRPC health port (9003) from anywhere.
"""
from __future__ import annotations

from builder.deploy.context import (HEALTH_PORT, METRICS_PORT, OPENAI_PORT, TRITON_GRPC_PORT,
                                    TRITON_HTTP_PORT, DeployContext)
from builder.deploy.names import EPP_SUFFIX

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090


def service(ctx: DeployContext) -> dict:
    """ClusterIP Service over the pods (clients, the ServiceMonitor's scrape target)."""
    ports = []
    if not ctx.multi_rank:
        ports.append({"name": "openai", "port": OPENAI_PORT, "targetPort": "openai"})
    if ctx.triton_exposed:
        ports += [{"name": "triton-http", "port": TRITON_HTTP_PORT, "targetPort": "triton-http"},
                  {"name": "triton-grpc", "port": TRITON_GRPC_PORT, "targetPort": "triton-grpc"}]
    ports.append({"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"})
    for port in ports:
        port["protocol"] = "TCP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": ctx.metadata(),
            "spec": {"type": "ClusterIP", "selector": ctx.selector, "ports": ports}}


def disruption_budget(ctx: DeployContext) -> dict:
    """One pod at a time may be evicted (node drains, upgrades), each with its own drain."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": ctx.metadata(),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": ctx.selector}}}


def _namespaces(*names: str) -> list[dict]:
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: name}}}
            for name in dict.fromkeys(names)]


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def epp_pod_selector(ctx: DeployContext) -> dict[str, str]:
    return ctx.labels("endpoint-picker")


def network_policy(ctx: DeployContext) -> dict:
    """Ingress to the model-server pods, port by port (see the module docstring)."""
    d = ctx.deployment
    rules = []
    if not ctx.multi_rank:
        rules.append({"ports": _tcp(OPENAI_PORT),
                      "from": _namespaces(d.gateway_namespace, *d.client_namespaces)})
        rules.append({"ports": _tcp(HEALTH_PORT)})
    if ctx.triton_exposed:
        rules.append({"ports": _tcp(TRITON_HTTP_PORT, TRITON_GRPC_PORT),
                      "from": _namespaces(d.gateway_namespace)})
    rules.append({"ports": _tcp(METRICS_PORT),
                  "from": _namespaces(d.monitoring_namespace, d.gateway_namespace)
                  + [{"podSelector": {"matchLabels": epp_pod_selector(ctx)}}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": ctx.metadata(),
            "spec": {"podSelector": {"matchLabels": ctx.selector}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def epp_network_policy(ctx: DeployContext) -> dict:
    """Ingress to the endpoint picker: ext-proc from the gateway only."""
    d = ctx.deployment
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": ctx.metadata(EPP_SUFFIX, "endpoint-picker"),
            "spec": {"podSelector": {"matchLabels": epp_pod_selector(ctx)},
                     "policyTypes": ["Ingress"],
                     "ingress": [
                         {"ports": _tcp(EPP_GRPC_PORT), "from": _namespaces(d.gateway_namespace)},
                         {"ports": _tcp(EPP_METRICS_PORT),
                          "from": _namespaces(d.monitoring_namespace)},
                         {"ports": _tcp(EPP_HEALTH_PORT)}]}}

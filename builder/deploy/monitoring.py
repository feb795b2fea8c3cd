"""The Prometheus Operator ServiceMonitor scraping Triton's metrics port of every replica.

Prometheus adds `namespace`, `service` and `pod` labels to each series, which the KEDA queries
and the Prometheus-adapter rules select by. A Prometheus whose `serviceMonitorSelector` asks for
a label (kube-prometheus-stack: `release: <its release>`) needs it added to this object.
"""
from __future__ import annotations

from builder.deploy.context import DeployContext

SCRAPE_INTERVAL = "15s"


def service_monitor(ctx: DeployContext) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": ctx.metadata(),
            "spec": {"selector": {"matchLabels": ctx.labels("model-server")},
                     "namespaceSelector": {"matchNames": [ctx.namespace]},
                     "endpoints": [{"port": "metrics", "path": "/metrics",
                                    "interval": SCRAPE_INTERVAL}]}}

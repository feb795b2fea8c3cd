"""The endpoint picker (EPP) of the InferencePool: its Deployment, Service, RBAC and config.

Flags (gateway-api-inference-extension v1.5.0, `pkg/epp/server/options.go`): `--pool-name`,
`--pool-namespace`, `--pool-group` name the InferencePool; `--config-file` the
EndpointPickerConfig (`gateway.epp_config`); `--model-server-metrics-port 8002` scrapes Triton's
metrics port rather than the pool's target port (deprecated in v1.5.0 but the only way there to
scrape a second port); `--grpc-port` 9002 (ext-proc from the gateway), `--grpc-health-port`
9003, `--metrics-port` 9090 (its own metrics, behind Kubernetes authn/authz, hence the
ClusterRole for token and access reviews). One replica with the Recreate strategy, as upstream
recommends: the prefix-cache scorer's state lives in the process.
"""
from __future__ import annotations

import yaml

from builder.deploy.context import METRICS_PORT, DeployContext
from builder.deploy.names import EPP_SUFFIX, metrics_auth_name
from builder.deploy.gateway import EPP_CONFIG_FILE, EPP_IMAGE, POOL_GROUP, epp_config
from builder.deploy.network import (EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT,
                                    epp_pod_selector)

COMPONENT = "endpoint-picker"
CONFIG_DIR = "/config"
EPP_UID = 65532  # the distroless image's nonroot user


def _meta(ctx: DeployContext, suffix: str = "") -> dict:
    return ctx.metadata(f"{EPP_SUFFIX}{suffix}", COMPONENT)


def epp_args(ctx: DeployContext) -> list[str]:
    return ["--pool-name", ctx.name, "--pool-namespace", ctx.namespace,
            "--pool-group", POOL_GROUP,
            "--config-file", f"{CONFIG_DIR}/{EPP_CONFIG_FILE}",
            "--model-server-metrics-port", str(METRICS_PORT),
            "--grpc-port", str(EPP_GRPC_PORT), "--grpc-health-port", str(EPP_HEALTH_PORT),
            "--metrics-port", str(EPP_METRICS_PORT),
            "--zap-encoder", "json", "--tracing=false"]


def config_map(ctx: DeployContext) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(ctx),
            "data": {EPP_CONFIG_FILE: yaml.safe_dump(epp_config(ctx), sort_keys=False)}}


def _grpc_probe(period: int) -> dict:
    return {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"},
            "periodSeconds": period}


def epp_deployment(ctx: DeployContext) -> dict:
    env = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
           for name, path in (("NAMESPACE", "metadata.namespace"), ("POD_NAME", "metadata.name"))]
    container = {
        "name": "epp", "image": EPP_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": epp_args(ctx), "env": env,
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT}],
        "livenessProbe": {**_grpc_probe(10), "initialDelaySeconds": 5},
        "readinessProbe": _grpc_probe(2),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                      "limits": {"cpu": "4", "memory": "4Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = {
        "serviceAccountName": ctx.epp_name,
        # As long as the model servers' own grace period: requests it routed may still stream.
        "terminationGracePeriodSeconds": ctx.grace_period_seconds,
        "securityContext": {"runAsNonRoot": True, "runAsUser": EPP_UID, "runAsGroup": EPP_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": ctx.epp_name}},
                    {"name": "tmp", "emptyDir": {}}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(ctx),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": epp_pod_selector(ctx)},
                     "template": {"metadata": {"labels": epp_pod_selector(ctx)}, "spec": pod}}}


def epp_service(ctx: DeployContext) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(ctx),
            "spec": {"type": "ClusterIP", "selector": epp_pod_selector(ctx), "ports": [
                {"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "protocol": "TCP",
                 "targetPort": EPP_GRPC_PORT},
                {"name": "http-metrics", "port": EPP_METRICS_PORT, "protocol": "TCP",
                 "targetPort": EPP_METRICS_PORT}]}}


def _binding(kind: str, meta: dict, role: str, ctx: DeployContext) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding",
            "metadata": meta,
            "subjects": [{"kind": "ServiceAccount", "name": ctx.epp_name,
                          "namespace": ctx.namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role}}


def epp_rbac(ctx: DeployContext) -> list[dict]:
    """ServiceAccount; a Role to watch the pool, its pods and objectives; a ClusterRole for the
    reviews that guard its metrics endpoint (cluster-scoped, so named after the namespace)."""
    watch = ["get", "watch", "list"]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(ctx),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": watch},
                      {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"],
                       "verbs": watch},
                      {"apiGroups": ["inference.networking.x-k8s.io"],
                       "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                       "verbs": watch}]}
    cluster_name = metrics_auth_name(ctx.namespace, ctx.name)
    cluster_meta = {"name": cluster_name, "labels": ctx.labels(COMPONENT)}
    cluster_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": cluster_meta,
        "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                   "verbs": ["create"]},
                  {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
                   "verbs": ["create"]}]}
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(ctx)},
            role, _binding("Role", _meta(ctx), ctx.epp_name, ctx),
            cluster_role, _binding("ClusterRole", cluster_meta, cluster_name, ctx)]

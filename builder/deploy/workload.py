"""The Deployment: the model-server pods, their volumes, security and placement.

Non-root (`runAsUser` from the spec), no privilege escalation, every capability dropped and a
read-only root filesystem; what must be written goes to emptyDirs: /tmp (forge serve's private
Triton backend directory, logs, the kernel cache under HOME) and /dev/shm (Triton's Python
backend and MPI exchange tensors there; the container default of 64 MiB is too small).

Rolling updates surge one pod and keep every old one until the new one is ready
(maxUnavailable 0); an old pod then drains (preStop) while the gateway already sends new
requests elsewhere. With an autoscaler the replica count is the autoscaler's, so `replicas` is
left out (re-applying the manifests would otherwise reset it).
"""
from __future__ import annotations

from builder.deploy.context import GPU_RESOURCE, DeployContext
from builder.deploy.server import server_container

MODEL_MOUNT = "/models"


def volumes(ctx: DeployContext) -> tuple[list[dict], list[dict]]:
    """(pod volumes, the server's volume mounts)."""
    shm = ctx.deployment.resources.shm_size
    pod = [{"name": "tmp", "emptyDir": {}},
           {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm)}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if ctx.deployment.model_source == "volume":
        pod.append({"name": "models", "persistentVolumeClaim": {
            "claimName": ctx.deployment.volume_claim, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
    return pod, mounts


def pod_spec(ctx: DeployContext) -> dict:
    uid = ctx.deployment.run_as_user
    pod_volumes, mounts = volumes(ctx)
    spec: dict = {
        "terminationGracePeriodSeconds": ctx.grace_period_seconds,
        # The pod talks to no Kubernetes API: no token to steal.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                            "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}},
        "nodeSelector": ctx.node_selector,
        "containers": [server_container(ctx, mounts)],
        "volumes": pod_volumes,
    }
    if ctx.gpus:
        # GPU nodes are commonly tainted so that only pods asking for GPUs land there.
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists",
                                "effect": "NoSchedule"}]
    return spec


def deployment(ctx: DeployContext) -> dict:
    """The apps/v1 Deployment running the model server."""
    spec: dict = {
        "selector": {"matchLabels": ctx.selector},
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": ctx.pod_labels}, "spec": pod_spec(ctx)},
    }
    if ctx.deployment.autoscaling.kind == "none":
        spec = {"replicas": ctx.deployment.replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": ctx.name, "namespace": ctx.namespace, "labels": ctx.selector},
            "spec": spec}

"""The model-server container: its command, ports, probes and drain.

One rank (tp * pp == 1, every CPU engine): `forge serve` runs tritonserver, the OpenAI API and
the health port. The probes ask forge serve (`builder.serving.health`): startup = the engine is
loaded and its kernels compiled, readiness = it takes traffic (false while draining or while the
engine restarts), liveness = it makes progress or recovers by itself. The preStop hook is
`forge drain --wait`: readiness turns false at once, the endpoint leaves the Service and the
gateway, and streams in flight finish within the drain timeout before SIGTERM arrives.

Several ranks (tp * pp > 1): NVIDIA's `launch_triton_server.py --world_size N` starts one
tritonserver per GPU under MPI and returns; forge serve does not run there (it starts a single
tritonserver process). The probes are then Triton's own: `/v2/health/ready` for startup and
readiness (ready = rank 0 has loaded every model), `/v2/health/live` for liveness, asked by an
exec probe on the container's loopback (the port takes no key, so the NetworkPolicy admits only
the gateway namespace to it, and an httpGet probe from the node would be refused). The preStop
sends SIGTERM to the ranks: Triton stops taking requests and lets those in flight finish within
`--exit-timeout-secs` (the drain timeout).
"""
from __future__ import annotations

import math

from builder.deploy.context import (ALL_ADDRESSES, GPU_RESOURCE, HEALTH_PORT,
                                    LAUNCH_TRITON_SERVER, LOOPBACK, METRICS_PORT, OPENAI_PORT,
                                    STARTUP_SECONDS, TRITON_GRPC_PORT, TRITON_HTTP_PORT,
                                    DeployContext)
from builder.serving.health import LIVENESS_PATH, READINESS_PATH, STARTUP_PATH

API_KEY_ENV = "LLM_FORGE_API_KEY"
API_KEY_SECRET_KEY = "api-key"
STARTUP_PERIOD = 10
TRITON_READY_PATH = "/v2/health/ready"
TRITON_LIVE_PATH = "/v2/health/live"


def serve_args(ctx: DeployContext) -> list[str]:
    """`forge serve`'s arguments in the pod: every address a port binds to is explicit."""
    drain = f"{ctx.deployment.drain_timeout:g}"
    return ["serve", "--repository", ctx.deployment.repository_path,
            "--http-port", str(TRITON_HTTP_PORT), "--grpc-port", str(TRITON_GRPC_PORT),
            "--metrics-port", str(METRICS_PORT),
            "--openai-port", str(OPENAI_PORT), "--host", ALL_ADDRESSES,
            "--health-port", str(HEALTH_PORT),
            "--metrics-host", ALL_ADDRESSES, "--triton-host", ctx.triton_host,
            "--drain-timeout", drain, "--ready-timeout", str(STARTUP_SECONDS)]


def launch_script(ctx: DeployContext) -> str:
    """The shell of a multi-rank pod: NVIDIA's launcher, then live as long as the ranks do
    (the launcher returns once mpirun is started, so the container waits for tritonserver)."""
    drain = max(1, math.ceil(ctx.deployment.drain_timeout))
    return (f"python3 {LAUNCH_TRITON_SERVER} --world_size {ctx.spec.parallelism.world_size} "
            f"--model_repo {ctx.deployment.repository_path} --http_port {TRITON_HTTP_PORT} "
            f"--grpc_port {TRITON_GRPC_PORT} --metrics_port {METRICS_PORT} "
            f"--exit_timeout {drain}\n"
            "sleep 10\n"
            "while pgrep -x tritonserver >/dev/null; do sleep 5; done\n"
            "echo 'tritonserver exited' >&2\nexit 1\n")


def _http_probe(path: str, port: int, period: int, failures: int, timeout: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _loopback_probe(path: str, port: int, period: int, failures: int, timeout: int) -> dict:
    """GET `path` on the container's own loopback, run by the kubelet inside the container
    (exit 1 on an error status or no answer). For Triton's HTTP port under MPI: the
    NetworkPolicy admits it from the gateway namespace only, and an httpGet probe comes from
    the node, which a policy cannot name portably (CNIs differ on node traffic)."""
    script = (f"import urllib.request; urllib.request.urlopen("
              f"'http://{LOOPBACK}:{port}{path}', timeout={timeout - 1})")
    return {"exec": {"command": ["python3", "-c", script]}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def probes(ctx: DeployContext) -> dict:
    """startupProbe, readinessProbe and livenessProbe of the model-server container: forge
    serve's health port, open to every source; under MPI Triton's own endpoints, asked from
    inside the container."""
    if ctx.multi_rank:
        ready, live, port = TRITON_READY_PATH, TRITON_LIVE_PATH, TRITON_HTTP_PORT
        startup, probe = TRITON_READY_PATH, _loopback_probe
    else:
        ready, live, port, startup = READINESS_PATH, LIVENESS_PATH, HEALTH_PORT, STARTUP_PATH
        probe = _http_probe
    return {
        # Liveness and readiness wait for startup: a long first start is not a hang.
        "startupProbe": probe(startup, port, STARTUP_PERIOD, STARTUP_SECONDS // STARTUP_PERIOD,
                              5),
        # Two misses (10 s) take a pod out of the Service: a drain or an engine restart.
        "readinessProbe": probe(ready, port, 5, 2, 5),
        # forge serve's liveness already waits out in-place recovery; three misses restart it.
        "livenessProbe": probe(live, port, 10, 3, 5),
    }


def pre_stop(ctx: DeployContext) -> dict:
    if ctx.multi_rank:
        command = ["/bin/sh", "-c", "pkill -TERM -x tritonserver; "
                   "while pgrep -x tritonserver >/dev/null; do sleep 1; done"]
    else:
        command = ["forge", "drain", "--health-port", str(HEALTH_PORT), "--wait"]
    return {"exec": {"command": command}}


def container_ports(ctx: DeployContext) -> list[dict]:
    """The ports other pods may reach; loopback-bound Triton ports are not listed."""
    ports = []
    if not ctx.multi_rank:
        ports += [{"name": "openai", "containerPort": OPENAI_PORT, "protocol": "TCP"},
                  {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}]
    if ctx.triton_exposed:
        ports += [{"name": "triton-http", "containerPort": TRITON_HTTP_PORT, "protocol": "TCP"},
                  {"name": "triton-grpc", "containerPort": TRITON_GRPC_PORT, "protocol": "TCP"}]
    ports.append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    return ports


def environment(ctx: DeployContext) -> list[dict]:
    """The API key from its Secret (without the Secret or its key the pod does not start; with
    an empty key forge serve exits 2); HOME and TMPDIR on the writable /tmp (the root
    filesystem is read-only)."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp"}]
    if not ctx.multi_rank:
        env.insert(0, {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": ctx.deployment.api_key_secret, "key": API_KEY_SECRET_KEY,
            "optional": False}}})
    return env


def resources(ctx: DeployContext) -> dict:
    r = ctx.deployment.resources
    memory_request, memory_limit = ctx.memory
    requests = {"cpu": str(r.cpu_request), "memory": memory_request}
    limits = {"cpu": str(r.cpu_limit), "memory": memory_limit}
    if ctx.gpus:
        # Extended resources: the request is the limit; one GPU per rank.
        limits[GPU_RESOURCE] = str(ctx.gpus)
    return {"requests": requests, "limits": limits}


def server_container(ctx: DeployContext, volume_mounts: list[dict]) -> dict:
    """The model-server container of the Deployment's pod."""
    if ctx.multi_rank:
        command, args = ["/bin/sh", "-c"], [launch_script(ctx)]
    else:
        command, args = ["forge"], serve_args(ctx)
    return {
        "name": "server", "image": ctx.image, "imagePullPolicy": "IfNotPresent",
        "command": command, "args": args, "env": environment(ctx),
        "ports": container_ports(ctx), **probes(ctx),
        "lifecycle": {"preStop": pre_stop(ctx)},
        "resources": resources(ctx),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": volume_mounts,
    }

"""`forge serve`'s probe endpoints, as Kubernetes (or any supervisor) asks them.

Served on forge serve's health port (`--health-port`, bound to `--host`):

- `STARTUP_PATH`: the server has started (tritonserver ready, the engine loaded, its kernels
  compiled; the OpenAI API up when asked for).
- `READINESS_PATH`: it takes traffic now (not draining, the engine not restarting, the model
  not unloaded by the supervisor).
- `LIVENESS_PATH`: it makes progress, or recovers by itself; failing only when in-place
  recovery did not bring the engine back, so the kubelet restarting the pod is the right move.
- `DRAIN_PATH` (POST, loopback clients only): start the drain, as SIGTERM does.
"""
from __future__ import annotations

DEFAULT_HEALTH_PORT = 8003
STARTUP_PATH = "/health/startup"
READINESS_PATH = "/health/ready"
LIVENESS_PATH = "/health/live"
DRAIN_PATH = "/drain"

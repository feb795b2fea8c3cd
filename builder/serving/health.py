"""`forge serve`'s probe endpoints, as Kubernetes (or any supervisor) asks them, and what they say.

Served on forge serve's health port (`--health-port`, bound to `--host`; `health_server.py`):

- `STARTUP_PATH`: the server has started (tritonserver ready, the engine loaded, its kernels
  compiled; the OpenAI API up when asked for).
- `READINESS_PATH`: it takes traffic now (not draining, the engine not restarting, the model
  not unloaded by the supervisor).
- `LIVENESS_PATH`: it makes progress, or recovers by itself; failing only when in-place
  recovery did not bring the engine back, so the kubelet restarting the pod is the right move.
- `DRAIN_PATH` (POST, loopback clients only): start the drain, as SIGTERM does.

`HealthState` holds what they answer. forge serve's main thread marks the start and the drain;
each model's supervisor reports what its probes find. The bounds:

- `RESTART_LIMIT_SECONDS` (60 s): how long the engine may answer "restarting" (an in-place
  restart after a crash or a freeze; measured 5-8 s after a kill -9) before the supervisor
  treats it as down and unloads and reloads the model.
- `LIVE_LIMIT_SECONDS` (120 s): how long a model may go without answering its probe as serving
  (restarting, unloaded and reloading, or no answer from tritonserver at all) before liveness
  fails: the in-place restart (up to RESTART_LIMIT_SECONDS) and one reload (a minute) had their
  chance. A supervisor that gave up (its reload limit) fails liveness at once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

DEFAULT_HEALTH_PORT = 8003
STARTUP_PATH = "/health/startup"
READINESS_PATH = "/health/ready"
LIVENESS_PATH = "/health/live"
DRAIN_PATH = "/drain"

RESTART_LIMIT_SECONDS = 60.0
LIVE_LIMIT_SECONDS = 120.0

# A model's condition, as its supervisor last found it.
SERVING = "serving"
RESTARTING = "restarting"    # the engine is restarting in place: alive, not ready
UNANSWERED = "unanswered"    # tritonserver gave the probe no answer: ready until acted upon
UNLOADED = "unloaded"        # the supervisor unloaded the model (and is reloading it)
GAVE_UP = "gave_up"          # past the reload limit: stays unloaded
_NOT_READY = (RESTARTING, UNLOADED, GAVE_UP)


@dataclass(frozen=True)
class Verdict:
    """One probe's answer: HTTP 200 when `ok`, else 503; `status` and `reason` go in the body."""

    ok: bool
    status: str
    reason: str = ""

    @property
    def http_status(self) -> int:
        return 200 if self.ok else 503

    def body(self) -> dict[str, str]:
        return {"status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class _Condition:
    kind: str
    reason: str
    since: float            # when this condition began
    not_serving_since: float  # when the model last stopped answering as serving


class HealthState:
    """What the probes answer. Thread-safe: written by forge serve's main thread (start, drain)
    and its supervisors (one per model), read by the health server's threads; `begin_drain`
    takes no lock, so a signal handler may call it."""

    def __init__(self, live_limit: float = LIVE_LIMIT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not live_limit > 0:
            raise ValueError(f"live_limit must be a number of seconds > 0, got {live_limit!r}")
        self.live_limit, self._clock = live_limit, clock
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._draining = threading.Event()
        self._drained = threading.Event()
        self._models: dict[str, _Condition] = {}

    # -- forge serve's main thread -------------------------------------------------------------
    def mark_started(self) -> None:
        self._started.set()

    def begin_drain(self) -> None:
        self._draining.set()

    def mark_drained(self) -> None:
        self._drained.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    # -- the supervisors -----------------------------------------------------------------------
    def serving(self, model: str) -> None:
        self._set(model, SERVING, "")

    def restarting(self, model: str, reason: str) -> None:
        self._set(model, RESTARTING, reason)

    def unanswered(self, model: str, reason: str) -> None:
        self._set(model, UNANSWERED, reason)

    def unloaded(self, model: str, reason: str) -> None:
        self._set(model, UNLOADED, reason)

    def gave_up(self, model: str, reason: str) -> None:
        self._set(model, GAVE_UP, reason)

    def _set(self, model: str, kind: str, reason: str) -> None:
        now = self._clock()
        with self._lock:
            last = self._models.get(model)
            since = last.since if last is not None and last.kind == kind else now
            if kind == SERVING or last is None or last.kind == SERVING:
                not_serving_since = now
            else:
                not_serving_since = last.not_serving_since
            self._models[model] = _Condition(kind, reason, since, not_serving_since)

    # -- the probes ----------------------------------------------------------------------------
    def startup(self) -> Verdict:
        if self._started.is_set():
            return Verdict(True, "started")
        return Verdict(False, "starting", "tritonserver is loading the models")

    def readiness(self) -> Verdict:
        if self._drained.is_set():
            return Verdict(False, "drained", "the drain is over; forge serve is stopping")
        if self._draining.is_set():
            return Verdict(False, "draining", "the server is shutting down: new requests are "
                                              "refused, requests in flight finish")
        if not self._started.is_set():
            return self.startup()
        now = self._clock()
        with self._lock:
            for model, condition in sorted(self._models.items()):
                if condition.kind in _NOT_READY:
                    return Verdict(False, condition.kind,
                                   f"{model} {condition.kind.replace('_', ' ')} for "
                                   f"{now - condition.since:.1f} s: {condition.reason}")
        return Verdict(True, "ready")

    def liveness(self) -> Verdict:
        now = self._clock()
        with self._lock:
            conditions = sorted(self._models.items())
        for model, condition in conditions:
            if condition.kind == GAVE_UP:
                return Verdict(False, GAVE_UP, f"{model}: {condition.reason}")
        for model, condition in conditions:
            stalled = now - condition.not_serving_since
            if condition.kind != SERVING and stalled > self.live_limit:
                return Verdict(False, "stalled",
                               f"{model} has not answered its probe as serving for "
                               f"{stalled:.0f} s (limit {self.live_limit:g} s; now "
                               f"{condition.kind.replace('_', ' ')}: {condition.reason})")
        return Verdict(True, "live")

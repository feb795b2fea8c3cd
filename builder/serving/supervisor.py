"""`forge serve`'s supervisor: readiness that tells the truth, a model that heals itself.

Triton 2.51 keeps a Python model READY after its stub process dies (every request then fails
with "Stub process '<instance>' is not healthy", forever), and keeps our `tensorrt_llm` model
READY when its engine is down for good (the crash-loop limit of `supervision.py`). So the
supervisor asks the model itself: every `period` seconds it sends `tensorrt_llm` a `stop` request
under a reserved id (`serving_control.py`), which never reaches the engine: the model answers it
at once with an empty final response, or with an error once its engine is down for good.
An engine being restarted in place (after a crash or a freeze) answers `ENGINE_RESTARTING`:
alive but not ready, left to its restart for `restart_seconds` before the supervisor counts it
as down. What each probe finds goes to forge serve's `HealthState` (`health.py`).

On a failed probe it unloads the model through Triton's repository API: from that moment the
model, the ensemble built on it and (strict readiness) `/v2/health/ready` answer not ready. Then
it loads the model again (a new stub and a new engine; Triton loads the ensemble again with it),
and readiness is back once the load returns. After more than `max_reloads` failures within
`window_seconds` it stops reloading and leaves the server not ready, saying why.

Not ready on purpose: Triton's strict readiness ignores unloaded models, but not a model that
failed to load. `mark_not_ready` loads a stand-in model (`NOT_READY_MODEL`, sent with the load
request, never in the repository) whose initialize refuses with the reason.
"""
from __future__ import annotations

import base64
import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from builder.serving.health import RESTART_LIMIT_SECONDS, HealthState
from triton_backend.engine.supervision import CrashLoop, RestartPolicy
from triton_backend.models.serving_control import (ENGINE_RESTARTING, PROBE_REQUEST_ID,
                                                   STOP_REQUEST_INPUTS)

# The messages that mean the model cannot serve: Triton's for a dead stub, ours for a dead engine.
FAILURE_MARKERS = ("is not healthy", "the engine is down")
RESTARTING_MARKER = ENGINE_RESTARTING.split("(", 1)[0].rstrip()
NOT_READY_MODEL = "forge_serve_not_ready"
_NOT_READY_SOURCE = ("class TritonPythonModel:\n"
                     "    def initialize(self, args):\n"
                     "        raise RuntimeError({reason!r})\n")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool | None  # True: answered; False: cannot serve; None: inconclusive
    message: str = ""
    restarting: bool = False  # the engine is restarting in place (ok is None)
    answered: bool = True     # False: tritonserver gave no answer at all (ok is None)


def _post(url: str, body: dict | None, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _error_text(body: str) -> str:
    try:
        return str(json.loads(body).get("error", body))
    except (ValueError, AttributeError):
        return body


def _ask(http_url: str, model: str, endpoint: str, body: dict, timeout: float,
         alive_error: str | None = None) -> ProbeResult:
    """POST `body` to the model's `endpoint` and read the answer as a probe: 200 (or an error
    holding `alive_error`, which the model's own code gives) is alive, a failure marker is broken,
    anything else (or no answer) says nothing about the model."""
    try:
        status, text = _post(f"http://{http_url}/v2/models/{model}/{endpoint}", body, timeout)
    except (urllib.error.URLError, OSError) as exc:
        return ProbeResult(None, f"no answer: {exc}", answered=False)
    if status == 200:
        return ProbeResult(True)
    message = _error_text(text)
    if alive_error is not None and alive_error in message:
        return ProbeResult(True)
    if RESTARTING_MARKER in message:
        return ProbeResult(None, message, restarting=True)
    return ProbeResult(False if any(m in message for m in FAILURE_MARKERS) else None, message)


def control_request(http_url: str, model: str, request_id: str, timeout: float) -> ProbeResult:
    """A `stop` request under `request_id`, through Triton's HTTP `generate` endpoint."""
    body = {"id": request_id, **{name: [value] for name, value in STOP_REQUEST_INPUTS.items()}}
    return _ask(http_url, model, "generate", body, timeout)


# The other Python models, each asked something its own code answers at once without generating:
# (endpoint, JSON body, the answer's text when it is an error that still proves the stub alive).
_LIVENESS_PROBES = {
    "preprocessing": ("infer", {"inputs": [
        {"name": "QUERY", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]},
        {"name": "REQUEST_OUTPUT_LEN", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
        None),
    "postprocessing": ("infer", {"inputs": [
        {"name": "TOKENS_BATCH", "shape": [1, 1, 1], "datatype": "INT32", "data": [5]},
        {"name": "SEQUENCE_LENGTH", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
        None),
    "tensorrt_llm_bls": ("generate", {"text_input": "", "max_tokens": 1},
                         "text_input must not be empty"),
}
SUPERVISED_MODELS = ("tensorrt_llm", *_LIVENESS_PROBES)


def probe_model(http_url: str, model: str = "tensorrt_llm", timeout: float = 5.0) -> ProbeResult:
    """Can `model` serve? `tensorrt_llm` gets the control request; the other models of our
    repository a request their own code answers at once (a dead stub fails it by name)."""
    if model in _LIVENESS_PROBES:
        endpoint, body, alive_error = _LIVENESS_PROBES[model]
        return _ask(http_url, model, endpoint, body, timeout, alive_error)
    return control_request(http_url, model, PROBE_REQUEST_ID, timeout)


def supervised_models(repository_dir: Path) -> list[str]:
    """The models of `repository_dir` the supervisor can probe: our Python models."""
    found = []
    for model in SUPERVISED_MODELS:
        config = Path(repository_dir) / model / "config.pbtxt"
        if config.is_file() and re.search(r'backend:\s*"python"', config.read_text()):
            found.append(model)
    return found


def _repository_call(http_url: str, model: str, action: str, body: dict | None,
                     timeout: float) -> str | None:
    """POST Triton's model-control `action` (load, unload) for `model`; the error text, or None."""
    try:
        status, text = _post(f"http://{http_url}/v2/repository/models/{model}/{action}", body,
                             timeout)
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer: {exc}"
    return None if status == 200 else _error_text(text)


def unload_model(http_url: str, model: str, timeout: float = 30.0) -> str | None:
    """Ask Triton to unload `model` (it stops serving it at once); the error text, or None."""
    return _repository_call(http_url, model, "unload", None, timeout)


def load_model(http_url: str, model: str, timeout: float, parameters: dict | None = None
               ) -> str | None:
    """Load `model` (its dependents follow) and wait until Triton is done; the error, or None."""
    body = {"parameters": parameters} if parameters else None
    return _repository_call(http_url, model, "load", body, timeout)


def mark_not_ready(http_url: str, reason: str, timeout: float = 60.0) -> str | None:
    """Make `/v2/health/ready` answer not ready for good (see the module), `reason` in the log;
    the error text, or None."""
    source = _NOT_READY_SOURCE.format(reason=reason).encode()
    error = load_model(http_url, NOT_READY_MODEL, timeout, {
        "config": json.dumps({"backend": "python", "max_batch_size": 0}),
        "file:1/model.py": base64.b64encode(source).decode()})
    return None if error is None or reason in error else error  # its refusal is the point


class Supervisor(threading.Thread):
    """Probes `model` on a running server and reloads it when it cannot serve (see the module).

    `report` receives one line per event (a failed probe, an engine restarting, a reload, giving
    up); `health` what each probe found; `stop()` ends the thread (before a drain, so nothing is
    reloaded while the server stops)."""

    def __init__(self, http_url: str, *, model: str = "tensorrt_llm", period: float = 1.0,
                 probe_timeout: float = 5.0, hung_seconds: float = 30.0,
                 restart_seconds: float = RESTART_LIMIT_SECONDS, max_reloads: int = 3,
                 window_seconds: float = 300.0, load_timeout: float = 900.0,
                 health: HealthState | None = None, report: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name=f"forge-serve-supervisor-{model}", daemon=True)
        self.http_url, self.model, self.period = http_url, model, period
        self.probe_timeout, self.hung_seconds = probe_timeout, hung_seconds
        self.restart_seconds = restart_seconds
        self.load_timeout, self.report, self._clock = load_timeout, report, clock
        self.health = health if health is not None else HealthState(clock=clock)
        self.reloads = CrashLoop(RestartPolicy(max_reloads, window_seconds), clock=clock)
        self.gave_up = threading.Event()
        self._halt = threading.Event()
        self._unanswered_since: float | None = None
        self._restarting_since: float | None = None
        self._failed_load: str | None = None  # why the last reload failed, until one succeeds

    def halt(self) -> None:
        """Probe and reload nothing more; a probe in flight ends within `probe_timeout`."""
        self._halt.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.halt()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        while not self._halt.wait(self.period):
            result = probe_model(self.http_url, self.model, self.probe_timeout)
            if self._halt.is_set():
                continue
            reason = self._verdict(result)
            if reason is None:
                continue
            self._recover(reason)
            if self.gave_up.is_set():
                return

    def _verdict(self, result: ProbeResult) -> str | None:
        """Why the model must be unloaded and reloaded after this probe, or None; `health` told
        what the probe found. An engine restarting in place gets `restart_seconds`, a probe with
        no conclusive answer `hung_seconds`, before either counts as a failure."""
        now = self._clock()
        if result.ok:
            if self._restarting_since is not None:
                self.report(f"supervisor: {self.model}'s engine is serving again after "
                            f"{now - self._restarting_since:.1f} s of restarting in place")
            self._unanswered_since = self._restarting_since = None
            self.health.serving(self.model)
            return None
        if self._failed_load is not None:
            # Our own reload left the model unloaded: Triton's "unknown model" is conclusive.
            self._unanswered_since = self._restarting_since = None
            return f"the last reload failed ({self._failed_load})"
        if result.ok is False:
            self._unanswered_since = self._restarting_since = None
            return result.message
        if result.restarting:
            self._unanswered_since = None
            if self._restarting_since is None:
                self._restarting_since = now
                self.report(f"supervisor: {result.message}; not ready until it is back (a "
                            f"reload after {self.restart_seconds:g} s)")
            self.health.restarting(self.model, result.message)
            if now - self._restarting_since < self.restart_seconds:
                return None
            self._restarting_since = None
            return (f"the engine still restarting after {self.restart_seconds:g} s "
                    f"({result.message})")
        if not result.answered:
            self.health.unanswered(self.model, result.message)
        if self._unanswered_since is None:
            self._unanswered_since = now
        if now - self._unanswered_since < self.hung_seconds:
            return None
        self._unanswered_since = None
        return (f"no conclusive answer to the health probe for {self.hung_seconds:g} s "
                f"(last: {result.message})")

    def _recover(self, reason: str) -> None:
        started = self._clock()
        self.health.unloaded(self.model, reason)
        self.report(f"supervisor: {self.model} cannot serve ({reason}); unloading it, the "
                    f"server is not ready until it is back")
        error = unload_model(self.http_url, self.model)
        if error:
            self.report(f"supervisor: unloading {self.model} failed: {error}")
        if self._halt.is_set():  # the server is stopping: a reload would only delay it
            return
        if not self.reloads.allow_restart():
            self._give_up(reason)
            return
        error = load_model(self.http_url, self.model, self.load_timeout)
        took = self._clock() - started
        self._failed_load = error.strip().splitlines()[0] if error else None
        if error:
            self.report(f"supervisor: reloading {self.model} failed after {took:.1f} s: {error}")
        else:
            self.health.serving(self.model)
            self.report(f"supervisor: {self.model} reloaded, ready again after {took:.1f} s "
                        f"({self._budget()})")

    def _give_up(self, reason: str) -> None:
        why = (f"forge serve stopped reloading {self.model}: {self._budget()}; "
               f"last failure: {reason}")
        self.health.gave_up(self.model, why)
        mark_not_ready(self.http_url, why)
        self.gave_up.set()
        self.report(f"supervisor: {why}; {self.model} stays unloaded and the server not ready "
                    f"until forge serve is restarted")

    def _budget(self) -> str:
        policy = self.reloads.policy
        return (f"{self.reloads.num_recent} failures within {policy.window_seconds:g} s, "
                f"reload limit {policy.max_restarts}")


def stop_supervisors(supervisors: list[Supervisor], timeout: float = 6.0,
                     report: Callable[[str], None] = print) -> None:
    """Halt every supervisor at once, then wait for them against one deadline (`timeout`, a probe's
    timeout and a little more): stopping them one after the other, each maybe inside a probe of
    a model busy with streams, delayed the drain by their sum. One still inside its probe is
    left to end it (a halted supervisor acts on no answer)."""
    for supervisor in supervisors:
        supervisor.halt()
    deadline = time.monotonic() + timeout
    for supervisor in supervisors:
        if supervisor.is_alive() and threading.current_thread() is not supervisor:
            supervisor.join(max(0.0, deadline - time.monotonic()))
    busy = [supervisor.model for supervisor in supervisors if supervisor.is_alive()]
    if busy:
        report(f"supervisor: still waiting for a probe of {', '.join(busy)}; draining anyway")

"""`forge serve`'s supervisor and drain: readiness that tells the truth, a model that heals itself.

Triton 2.51 keeps a Python model READY after its stub process dies (every request then fails
with "Stub process '<instance>' is not healthy", forever), and keeps our `tensorrt_llm` model
READY when its engine is down for good (the crash-loop limit of `supervision.py`). So the
supervisor asks the model itself: every `period` seconds it sends `tensorrt_llm` a `stop` request
under a reserved id (`serving_control.py`), which never reaches the engine: the model answers it
at once with an empty final response, or with an error once its engine is down for good.

On a failed probe it unloads the model through Triton's repository API: from that moment the
model, the ensemble built on it and (strict readiness) `/v2/health/ready` answer not ready. Then
it loads the model again (a new stub and a new engine; Triton loads the ensemble again with it),
and readiness is back once the load returns. After more than `max_reloads` failures within
`window_seconds` it stops reloading and leaves the server not ready, saying why.

Not ready on purpose: Triton's strict readiness ignores unloaded models, but not a model that
failed to load. `mark_not_ready` loads a stand-in model (`NOT_READY_MODEL`, sent with the load
request, never in the repository) whose initialize refuses with the reason.

The drain (`drain`) is ours because Triton's is not enough: on SIGTERM, Triton 2.51 stops the
ensemble's streams where they are (its steps are new requests, refused while exiting), waits its
exit timeout and then exits without a final response on them.
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

from builder.metrics_reader import scrape
from triton_backend.engine.supervision import CrashLoop, RestartPolicy
from triton_backend.models.serving_control import (PROBE_REQUEST_ID, STOP_REQUEST_INPUTS,
                                                   drain_request_id)

# The messages that mean the model cannot serve: Triton's for a dead stub, ours for a dead engine.
FAILURE_MARKERS = ("is not healthy", "the engine is down")
NOT_READY_MODEL = "forge_serve_not_ready"
RELAY_SECONDS = 1.0  # for a final response to pass from tensorrt_llm through the ensemble
CONTROL_SECONDS = 10.0  # for each of the drain's two calls (the drain request, readiness off)
SLOW_SECONDS = 2.0  # a drain phase that takes longer is reported with its time
_NOT_READY_SOURCE = ("class TritonPythonModel:\n"
                     "    def initialize(self, args):\n"
                     "        raise RuntimeError({reason!r})\n")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool | None  # True: answered; False: cannot serve; None: inconclusive
    message: str = ""


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
        return ProbeResult(None, f"no answer: {exc}")
    if status == 200:
        return ProbeResult(True)
    message = _error_text(text)
    if alive_error is not None and alive_error in message:
        return ProbeResult(True)
    return ProbeResult(False if any(m in message for m in FAILURE_MARKERS) else None, message)


def _control_request(http_url: str, model: str, request_id: str, timeout: float) -> ProbeResult:
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
    return _control_request(http_url, model, PROBE_REQUEST_ID, timeout)


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

    `report` receives one line per event (a failed probe, a reload, giving up); `stop()` ends the
    thread (before a drain, so nothing is reloaded while the server stops)."""

    def __init__(self, http_url: str, *, model: str = "tensorrt_llm", period: float = 1.0,
                 probe_timeout: float = 5.0, hung_seconds: float = 30.0, max_reloads: int = 3,
                 window_seconds: float = 300.0, load_timeout: float = 900.0,
                 report: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name=f"forge-serve-supervisor-{model}", daemon=True)
        self.http_url, self.model, self.period = http_url, model, period
        self.probe_timeout, self.hung_seconds = probe_timeout, hung_seconds
        self.load_timeout, self.report, self._clock = load_timeout, report, clock
        self.reloads = CrashLoop(RestartPolicy(max_reloads, window_seconds), clock=clock)
        self.gave_up = threading.Event()
        self._halt = threading.Event()

    def halt(self) -> None:
        """Probe and reload nothing more; a probe in flight ends within `probe_timeout`."""
        self._halt.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.halt()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        unanswered_since = None
        while not self._halt.wait(self.period):
            result = probe_model(self.http_url, self.model, self.probe_timeout)
            if self._halt.is_set() or result.ok:
                unanswered_since = None
                continue
            if result.ok is None:  # no answer, or one that says nothing about the model
                now = self._clock()
                unanswered_since = unanswered_since or now
                if now - unanswered_since < self.hung_seconds:
                    continue
                result = ProbeResult(False, f"no conclusive answer to the health probe for "
                                            f"{self.hung_seconds:g} s (last: {result.message})")
            unanswered_since = None
            self._recover(result.message)
            if self.gave_up.is_set():
                return

    def _recover(self, reason: str) -> None:
        started = self._clock()
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
        if error:
            self.report(f"supervisor: reloading {self.model} failed after {took:.1f} s: {error}")
        else:
            self.report(f"supervisor: {self.model} reloaded, ready again after {took:.1f} s "
                        f"({self._budget()})")

    def _give_up(self, reason: str) -> None:
        why = (f"forge serve stopped reloading {self.model}: {self._budget()}; "
               f"last failure: {reason}")
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


def active_requests(metrics_url: str, model: str = "tensorrt_llm") -> int | None:
    """Requests the model is still answering, from its `model_active_requests` counter."""
    try:
        stats = scrape(metrics_url, timeout=5.0).of(model)
    except (urllib.error.URLError, OSError):
        return None
    value = stats.get("model_active_requests")
    return None if value is None else int(value)


def drain(server, timeout: float, report: Callable[[str], None] = print,
          model: str = "tensorrt_llm") -> None:
    """Stop admission, let requests in flight finish up to `timeout` s, then stop the server.

    The model refuses new requests with the drain error from now on and, at `timeout`, cancels
    what still runs (it reads the same timeout from the environment the launcher gave the
    server); readiness turns false at once (`mark_not_ready`). Then tritonserver gets
    SIGTERM with nothing in flight, unloads the models and exits."""
    started = time.monotonic()
    result = _control_request(server.http_url, model, drain_request_id(server.control_token),
                              CONTROL_SECONDS)
    if result.ok is not True:
        report(f"drain: {model} did not take the drain request ({result.message})")
    _slow(report, "the drain request", started)
    marked = time.monotonic()
    error = mark_not_ready(server.http_url, "the server is shutting down (draining)",
                           timeout=CONTROL_SECONDS)
    if error:
        report(f"drain: readiness could not be turned off ({error}); draining anyway")
    _slow(report, "turning readiness off", marked)
    at_start = active_requests(server.metrics_url, model)
    deadline = started + timeout + 5.0  # the model ends what is left at `timeout`
    while server.is_alive() and time.monotonic() < deadline:
        if active_requests(server.metrics_url, model) == 0:
            # The last responses still pass postprocessing or the BLS: an ensemble step that
            # starts after tritonserver's SIGTERM is refused and its stream stalls.
            time.sleep(RELAY_SECONDS)
            break
        time.sleep(0.2)
    if at_start == 0:
        report("drain: no requests were in flight")
    else:
        count = f"{at_start} " if at_start else ""
        report(f"drain: {count}requests in flight ended after {time.monotonic() - started:.1f} s "
               f"(drain timeout {timeout:g} s)")


def _slow(report: Callable[[str], None], phase: str, started: float) -> None:
    """Say how long `phase` took when it held the drain up (a stopping server should show where
    its time went)."""
    took = time.monotonic() - started
    if took > SLOW_SECONDS:
        report(f"drain: {phase} took {took:.1f} s")

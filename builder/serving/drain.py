"""`forge serve`'s drain: on SIGTERM, Ctrl-C or `POST /drain`, requests in flight finish first.

The drain is ours because Triton's is not enough: on SIGTERM, Triton 2.51 stops the ensemble's
streams where they are (its steps are new requests, refused while exiting), waits its exit
timeout and then exits without a final response on them.

Once nothing is in flight, every model is unloaded through the repository API before tritonserver
gets its SIGTERM (`unload_models`): Triton 2.51 never finishes unloading a model version whose
stub died after a request was sent to it (the supervisor's probe finds a dead stub that way), and
on SIGTERM it waited its whole exit timeout for that version (60 s after a recovery, where the
pod's grace period is 45 s). With the others unloaded first, forge serve knows the one left is
that version and stops tritonserver at once (`TritonServer.stop(unloaded=True)`).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Callable

from builder.client.metrics_reader import scrape
from builder.serving.serve import UNLOAD_SECONDS
from builder.serving.supervisor import control_request, mark_not_ready, unload_model
from triton_backend.models.serving_control import drain_request_id

RELAY_SECONDS = 1.0  # for a final response to pass from tensorrt_llm through the ensemble
CONTROL_SECONDS = 10.0  # for each of the drain's two calls (the drain request, readiness off)
SLOW_SECONDS = 2.0  # a drain phase that takes longer is reported with its time
GAUGE_LAG_SECONDS = 0.3  # the model's counters are published every stats_period_ms (100 ms)


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
    result = control_request(server.http_url, model, drain_request_id(server.control_token),
                              CONTROL_SECONDS)
    if result.ok is not True:
        report(f"drain: {model} did not take the drain request ({result.message})")
    _slow(report, "the drain request", started)
    # Counted before readiness is turned off: that can take longer than the drain timeout on a
    # busy machine, and the requests cancelled at the timeout were in flight all the same. Not at
    # once: the gauge lags by the model's publish period, and a request that ended just before
    # the drain would still count.
    time.sleep(GAUGE_LAG_SECONDS)
    at_start = active_requests(server.metrics_url, model)
    marked = time.monotonic()
    error = mark_not_ready(server.http_url, "the server is shutting down (draining)",
                           timeout=CONTROL_SECONDS)
    if error:
        report(f"drain: readiness could not be turned off ({error}); draining anyway")
    _slow(report, "turning readiness off", marked)
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


def model_states(http_url: str, timeout: float = CONTROL_SECONDS) -> dict[str, str] | None:
    """Model -> state (READY, UNLOADING, UNAVAILABLE, ...) from Triton's repository index; None
    when it does not answer."""
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}",
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return {m["name"]: m.get("state", "") for m in json.loads(reply.read())}
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None


def unload_models(server, report: Callable[[str], None] = print,
                  timeout: float = UNLOAD_SECONDS) -> bool:
    """After the drain: unload every loaded model (each finalizes: the engine shuts down) and wait
    until Triton reports them all unloaded, within `timeout`. True when they are; then whatever
    keeps tritonserver from exiting on SIGTERM is a version it cannot unload (see the module)."""
    started = time.monotonic()
    states = model_states(server.http_url)
    if states is None:
        report("drain: tritonserver's repository index did not answer; stopping it as is")
        return False
    busy = sorted(m for m, state in states.items() if state == "READY")
    for model in busy:
        error = unload_model(server.http_url, model, timeout=CONTROL_SECONDS)
        if error:
            report(f"drain: unloading {model} failed ({error})")
    while time.monotonic() - started < timeout and server.is_alive():
        states = model_states(server.http_url) or {"?": "no answer"}
        busy = sorted(m for m, state in states.items() if state in ("READY", "UNLOADING"))
        if not busy and "?" not in states:
            _slow(report, "unloading the models", started)
            return True
        time.sleep(0.1)
    report(f"drain: models still loaded after {timeout:g} s: {', '.join(busy)}")
    return False

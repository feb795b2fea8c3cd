"""The `tensorrt_llm` Triton model: a thin adapter between Triton requests and one executor.

`initialize` builds the executor (by default an engine process whose main thread steps the engine:
see `process/main.py`) and a response thread. `execute` only parses, enqueues and
returns None: every request joins the executor the moment it arrives, so requests of all
clients share steps. The response thread is the one place that sends responses (FINAL on the
last), checks cancellation through each response sender and publishes the executor's counters.
`finalize` signals the thread, joins it, shuts the executor down and answers what is left.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from triton_backend.engine.admission import ServerBusy
from triton_backend.engine.request import FinishReason
from triton_backend.engine.process.watchdog import DEFAULT_FREEZE_SECONDS
from triton_backend.models.executor_factory import create_executor, engine_options
from triton_backend.models.instance_device import PARAMETER as GPU_DEVICE_IDS, instance_device
from triton_backend.models.metrics import ExecutorMetrics, outcome_of
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import (INPUT_NAMES, RequestDefaults, RequestError,
                                                     parse_request)
from triton_backend.models.response_converter import (ERROR_AS_OUTPUT, StreamState,
                                                      build_outputs, coalesce, error_outputs)
from triton_backend.engine.supervision import health_of
from triton_backend.models.serving_control import (DRAIN_CUT, DRAIN_REFUSED, ENGINE_DOWN,
                                                   ENGINE_RESTARTING, PROBE_REQUEST_ID,
                                                   drain_seconds, is_drain_request)
from triton_backend.models.triton_io import FINAL, make_response, read_inputs, send_error

CHECK_SECONDS = 0.1  # how often client cancellations are looked for
# Request parameters that say who sent a request: headers `forge serve` has tritonserver forward.
CLIENT_PARAMETERS = ("authorization", "x-llm-forge-client")
DRAIN_GRACE_SECONDS = 2.0  # after the drain timeout, for the engine to end what it cancelled
# The output holding a request's cancel key: an unguessable id a `stop` request may carry to end
# it. The ensemble passes it to postprocessing, the one step Triton 2.51 tells of a cancelled
# ensemble request (it never tells the running tensorrt_llm step).
CANCEL_KEY_OUTPUT = "cancel_key"


@dataclass
class ActiveRequest:
    sender: object
    state: StreamState
    stop_key: tuple[str, str] | None  # (client, request id) a `stop` must match; None: no id
    wanted: frozenset[str] | None  # the outputs the caller asked for; None: all
    error_as_output: bool = False  # see send_failure
    cancel_sent: bool = False
    cancel_key: str = ""  # see CANCEL_KEY_OUTPUT; "" when the caller did not ask for it


def send_failure(sender, message: str, error_as_output: bool) -> None:
    """End a request with `message`: an error response, or for a caller that set the
    `ERROR_AS_OUTPUT` request parameter (our BLS), a FINAL response carrying the message in
    `ERROR_OUTPUT`."""
    if error_as_output:
        sender.send(make_response(error_outputs(message)), flags=FINAL)
    else:
        send_error(sender, message)


def _parameters(request) -> dict:
    """The request's parameters (Triton's JSON of them); {} when there are none or they are bad."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (TypeError, ValueError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


def _error_as_output(request) -> bool:
    return _parameters(request).get(ERROR_AS_OUTPUT) is True


def client_of(request) -> str:
    """Who sent `request`: a digest of its client headers (`CLIENT_PARAMETERS`), "" for none.

    A `stop` by request id cancels only a request of the same client, so a client cannot end
    another's request by guessing its id. Clients that send neither header share one scope:
    their ids must be unguessable (our BLS and OpenAI front end use random ids).
    """
    found = sorted((str(key).lower(), str(value)) for key, value in _parameters(request).items()
                   if str(key).lower() in CLIENT_PARAMETERS)
    if not found:
        return ""
    return hashlib.sha256(json.dumps(found).encode()).hexdigest()


class TensorrtLlmModel:
    def initialize(self, args):
        params = ModelParams(args)
        self.decoupled = params.decoupled
        # KIND_GPU: the instance's GPU; KIND_MODEL: gpu_device_ids (see instance_device.py).
        device = instance_device(args, params.text(GPU_DEVICE_IDS))
        self.executor = create_executor(params.path("engine_dir"), engine_options(params, device),
                                        isolation=params.text("engine_isolation", "process"),
                                        num_threads=params.integer("engine_num_threads", 0),
                                        freeze_seconds=params.number("engine_freeze_seconds",
                                                                     DEFAULT_FREEZE_SECONDS))
        config = self.executor.config
        self.limits, self.vocab_size = config.limits, config.model.vocab_size
        self.defaults = RequestDefaults(
            temperature=params.number("default_temperature", 0.0),
            top_k=params.integer("default_top_k", 0), top_p=params.number("default_top_p", 1.0),
            exclude_input_in_output=params.flag("exclude_input_in_output", True))
        self.stats_period = params.integer("stats_period_ms", 100) / 1000.0
        self.metrics = ExecutorMetrics(pb_utils, args["model_name"], args["model_version"])
        self.lock = threading.Lock()
        self.active: dict[int, ActiveRequest] = {}
        self.by_stop_key: dict[tuple[str, str], int] = {}
        self.by_cancel_key: dict[str, int] = {}
        self.stopping = threading.Event()
        self.drain_deadline: float | None = None  # set by forge serve's drain request
        self.drain_cancelled = False
        self.drain_cut: set[int] = set()  # the requests the drain timeout cancelled
        self.metrics.publish(self.executor.get_stats())  # /metrics is complete from ready on
        self.thread = threading.Thread(target=self._response_loop, name="tensorrt_llm-responses",
                                       daemon=True)
        self.thread.start()

    # -- execute: parse and enqueue only ----------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except (RequestError, ValueError) as exc:
                self.metrics.count("invalid")
                send_failure(sender, str(exc), _error_as_output(request))
            except ServerBusy as exc:  # an executor in this process; the engine process
                self.metrics.count("rejected")  # answers busy with a final error instead
                send_failure(sender, str(exc), _error_as_output(request))
        return None

    def _parse(self, request):
        return parse_request(read_inputs(request, INPUT_NAMES), self.limits, self.vocab_size,
                             self.defaults, arrival_time_ns=time.time_ns(),
                             request_timeout_us=request.timeout())

    def _enqueue(self, request, sender) -> None:
        parsed = self._parse(request)
        triton_id = request.request_id()
        stop_key = (client_of(request), triton_id) if triton_id else None
        if parsed.stop:
            self._answer_control(triton_id)
            self._cancel_by_stop_key(stop_key, triton_id)
            sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
            return
        if self.drain_deadline is not None:
            raise RequestError(DRAIN_REFUSED)
        if parsed.request.streaming and not self.decoupled:
            raise RequestError("streaming (stream) needs the decoupled tensorrt_llm model; this "
                               "repository was emitted with decoupled: false")
        state = StreamState(input_ids=parsed.input_ids,
                            exclude_input_in_output=parsed.exclude_input_in_output,
                            arrival_time_ns=parsed.request.arrival_time_ns,
                            stop_words=parsed.request.stop_token_sequences)
        wanted = frozenset(request.requested_output_names()) or None
        if wanted is None or CANCEL_KEY_OUTPUT in wanted:
            state.cancel_key = f"cancel-{secrets.token_hex(16)}"
        # Registered under the lock the response thread takes, so no response can miss its sender.
        with self.lock:
            request_id = self.executor.enqueue_request(parsed.request)
            self.active[request_id] = ActiveRequest(sender, state, stop_key, wanted,
                                                    _error_as_output(request),
                                                    cancel_key=state.cancel_key)
            if stop_key is not None:
                self.by_stop_key[stop_key] = request_id
            if state.cancel_key:
                self.by_cancel_key[state.cancel_key] = request_id

    def _answer_control(self, triton_id: str) -> None:
        """forge serve's health probe and drain (serving_control.py): a stop request fails while
        the engine is down for good, the probe also while the engine restarts in place (other
        stops still cancel: a request held for the new engine ends at once); the drain request
        starts the drain."""
        health = health_of(self.executor)
        if health.state == "down":
            raise RequestError(ENGINE_DOWN.format(reason=self._down_reason()))
        if health.state == "restarting" and triton_id == PROBE_REQUEST_ID:
            raise RequestError(ENGINE_RESTARTING.format(reason=health.reason))
        if self.drain_deadline is None and is_drain_request(triton_id):
            self.drain_deadline = time.monotonic() + drain_seconds()

    def _down_reason(self) -> str:
        return getattr(self.executor, "down_reason", "") or "stopped"

    def _cancel_by_stop_key(self, stop_key: tuple[str, str] | None, triton_id: str) -> None:
        """NVIDIA's convention: `stop: true` with the same request id cancels the running one,
        here only when it comes from the same client (`client_of`). An id that is a request's
        cancel key (CANCEL_KEY_OUTPUT) cancels that request whoever sends it."""
        with self.lock:
            request_id = self.by_stop_key.get(stop_key) if stop_key is not None else None
            if request_id is None and triton_id:
                request_id = self.by_cancel_key.get(triton_id)
        if request_id is not None:
            self.executor.cancel_request(request_id)

    # -- the response thread: the one place that sends ----------------------------------------
    def _response_loop(self) -> None:
        # Responses go out the moment they arrive; cancellation checks and counters (each an IPC
        # round trip to the server) run at most every CHECK_SECONDS / stats period, so an idle
        # or prefilling engine is not interrupted by this process waking the server.
        next_check = next_stats = 0.0
        last_stats = None
        while not self.stopping.is_set():
            responses = self.executor.await_responses(timeout=CHECK_SECONDS)
            for response in coalesce(responses):
                self._deliver(response)
            if not responses and not self.executor.is_alive():
                # The executor is down for good (await returns at once): answer what is left
                # and wait instead of spinning.
                self._fail_active(ENGINE_DOWN.format(reason=self._down_reason()))
                self.stopping.wait(CHECK_SECONDS)
            now = time.monotonic()
            if self.drain_deadline is not None and now >= self.drain_deadline:
                self._end_drain(now)
            if now >= next_check:
                self._check_cancellations()
                next_check = now + CHECK_SECONDS
            if now >= next_stats:
                with self.lock:  # the model's own per-request state, for leak checks
                    tracked = {"model_active_requests": len(self.active),
                               "model_tracked_ids": len(self.by_stop_key)
                               + len(self.by_cancel_key)}
                stats = dict(self.executor.get_stats(), **tracked)
                if stats != last_stats:
                    self.metrics.publish(stats)
                    last_stats = stats
                next_stats = now + self.stats_period

    def _deliver(self, response) -> None:
        with self.lock:
            active = self.active.get(response.request_id)
            if active is not None and response.is_final:
                del self.active[response.request_id]
                if self.by_stop_key.get(active.stop_key) == response.request_id:
                    del self.by_stop_key[active.stop_key]
                self.by_cancel_key.pop(active.cancel_key, None)
        if active is None:
            return
        now_ns = time.time_ns()
        if response.is_final and response.request_id in self.drain_cut:
            response = self._cut_by_the_drain(response, active, now_ns)
        if response.is_final:
            self._observe(response, active.state, now_ns)
        try:
            if response.has_error:
                send_failure(active.sender, response.error, active.error_as_output)
                return
            outputs = build_outputs(response, active.state, now_ns, active.wanted)
            active.sender.send(make_response(outputs), flags=FINAL if response.is_final else 0)
        except Exception:  # the client is gone: stop spending steps on it
            if not response.is_final:
                self.executor.cancel_request(response.request_id)

    def _cut_by_the_drain(self, response, active: ActiveRequest, now_ns: int):
        """The final response of a request the drain timeout cancelled becomes the `DRAIN_CUT`
        error; its tokens, if any, go out first as a chunk of their own. Not for the ensemble's
        step (the one caller that asks for the cancel key): see `serving_control`."""
        self.drain_cut.discard(response.request_id)
        if response.has_error or (active.wanted is not None
                                  and CANCEL_KEY_OUTPUT in active.wanted):
            return response
        if response.output_token_ids:
            chunk = dataclasses.replace(response, is_final=False, finish_reason=None)
            try:
                active.sender.send(make_response(build_outputs(chunk, active.state, now_ns,
                                                               active.wanted)), flags=0)
            except Exception:
                pass  # the client is gone; the final below fails the same way, harmlessly
        return dataclasses.replace(response, output_token_ids=[], log_probs=[], top_ids=[],
                                   top_log_probs=[], finish_reason=FinishReason.ERROR,
                                   error=DRAIN_CUT.format(seconds=drain_seconds()))

    def _observe(self, response, state: StreamState, now_ns: int) -> None:
        """Per-request histograms and the outcome counter, at the final response."""
        first, last = state.first_token_time_ns, state.last_token_time_ns
        if response.output_token_ids:  # the final response's tokens leave now
            first, last = first or now_ns, now_ns
        reason = response.finish_reason.value if response.finish_reason else None
        try:
            self.metrics.observe_request(
                arrival_ns=state.arrival_time_ns, first_token_ns=first, last_token_ns=last,
                final_ns=now_ns, num_input_tokens=len(state.input_ids),
                num_output_tokens=response.num_output_tokens,
                outcome=outcome_of(response.error, reason), queue_ns=response.queue_time_ns)
        except Exception:  # metrics never cost a response
            pass

    def _fail_active(self, message: str) -> None:
        with self.lock:
            leftovers, self.active = list(self.active.values()), {}
            self.by_stop_key.clear()
            self.by_cancel_key.clear()
        for active in leftovers:
            try:
                send_failure(active.sender, message, active.error_as_output)
            except Exception:
                pass

    def _end_drain(self, now: float) -> None:
        """The drain timeout expired: what still runs is cancelled in the engine and ends with
        the drain error (`_cut_by_the_drain`), as does whatever the engine has not ended
        DRAIN_GRACE_SECONDS later."""
        if not self.drain_cancelled:
            self.drain_cancelled = True
            with self.lock:
                request_ids = list(self.active)
                self.drain_cut.update(request_ids)
            for request_id in request_ids:
                self.executor.cancel_request(request_id)
        elif now >= self.drain_deadline + DRAIN_GRACE_SECONDS:
            self._fail_active(DRAIN_CUT.format(seconds=drain_seconds()))

    def _check_cancellations(self) -> None:
        with self.lock:
            candidates = [(rid, a) for rid, a in self.active.items() if not a.cancel_sent]
        for request_id, active in candidates:
            if active.sender.is_cancelled():
                active.cancel_sent = True
                self.executor.cancel_request(request_id)

    def finalize(self):
        self.stopping.set()
        self.thread.join(timeout=30)
        self.executor.shutdown()
        # The executor ended what was in flight with CANCELLED finals; deliver them, so every
        # client gets its final response before this process exits.
        for response in self.executor.await_responses(timeout=0):
            self._deliver(response)
        self._fail_active("tensorrt_llm: the model is shutting down")

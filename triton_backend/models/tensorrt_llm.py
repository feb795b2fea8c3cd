"""The `tensorrt_llm` Triton model: a thin adapter between Triton requests and one executor.

`initialize` builds the executor (by default an engine process whose main thread steps the engine:
see `engine_process.py`) and a response thread. `execute` only parses, enqueues and
returns None: every request joins the executor the moment it arrives, so requests of all
clients share steps. The response thread is the one place that sends responses (FINAL on the
last), checks cancellation through each response sender and publishes the executor's counters.
`finalize` signals the thread, joins it, shuts the executor down and answers what is left.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from triton_backend.models.executor_factory import create_executor
from triton_backend.models.metrics import ExecutorMetrics
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import RequestDefaults, RequestError, parse_request
from triton_backend.models.response_converter import StreamState, build_outputs
from triton_backend.models.triton_io import FINAL, make_response, read_inputs, send_error

INPUT_NAMES = (
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
    "bad_words_list", "beam_width", "num_return_sequences", "temperature", "runtime_top_k",
    "runtime_top_p", "len_penalty", "repetition_penalty", "min_tokens", "presence_penalty",
    "frequency_penalty", "seed", "return_log_probs", "return_perf_metrics",
    "return_num_input_tokens", "return_num_output_tokens", "exclude_input_in_output", "stop",
    "streaming")
CHECK_SECONDS = 0.1  # how often client cancellations are looked for


@dataclass
class ActiveRequest:
    sender: object
    state: StreamState
    triton_id: str
    wanted: frozenset[str] | None  # the outputs the caller asked for; None: all
    cancel_sent: bool = False


class TensorrtLlmModel:
    def initialize(self, args):
        params = ModelParams(args)
        self.decoupled = params.decoupled
        self.executor = create_executor(params.path("engine_dir"),
                                        params.integer("kv_cache_num_blocks"),
                                        params.integer("kv_cache_memory_bytes"),
                                        isolation=params.text("engine_isolation", "process"),
                                        num_threads=params.integer("engine_num_threads", 0))
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
        self.by_triton_id: dict[str, int] = {}
        self.stopping = threading.Event()
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
                send_error(sender, str(exc))
        return None

    def _enqueue(self, request, sender) -> None:
        parsed = parse_request(read_inputs(request, INPUT_NAMES), self.limits, self.vocab_size,
                               self.defaults)
        triton_id = request.request_id()
        if parsed.stop:
            self._cancel_by_triton_id(triton_id)
            sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
            return
        if parsed.request.streaming and not self.decoupled:
            raise RequestError("streaming (stream) needs the decoupled tensorrt_llm model; this "
                               "repository was emitted with decoupled: false")
        state = StreamState(input_ids=parsed.input_ids,
                            exclude_input_in_output=parsed.exclude_input_in_output,
                            arrival_time_ns=time.time_ns(),
                            stop_words=parsed.request.stop_token_sequences)
        wanted = frozenset(request.requested_output_names()) or None
        # Registered under the lock the response thread takes, so no response can miss its sender.
        with self.lock:
            request_id = self.executor.enqueue_request(parsed.request)
            self.active[request_id] = ActiveRequest(sender, state, triton_id, wanted)
            if triton_id:
                self.by_triton_id[triton_id] = request_id

    def _cancel_by_triton_id(self, triton_id: str) -> None:
        """NVIDIA's convention: `stop: true` with the same request id cancels the running one."""
        with self.lock:
            request_id = self.by_triton_id.get(triton_id) if triton_id else None
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
            for response in self.executor.await_responses(timeout=CHECK_SECONDS):
                self._deliver(response)
            now = time.monotonic()
            if now >= next_check:
                self._check_cancellations()
                next_check = now + CHECK_SECONDS
            if now >= next_stats:
                stats = self.executor.get_stats()
                if stats != last_stats:
                    self.metrics.publish(stats)
                    last_stats = stats
                next_stats = now + self.stats_period

    def _deliver(self, response) -> None:
        with self.lock:
            active = self.active.get(response.request_id)
            if active is not None and response.is_final:
                del self.active[response.request_id]
                if self.by_triton_id.get(active.triton_id) == response.request_id:
                    del self.by_triton_id[active.triton_id]
        if active is None:
            return
        try:
            if response.has_error:
                send_error(active.sender, response.error)
                return
            outputs = build_outputs(response, active.state, time.time_ns(), active.wanted)
            active.sender.send(make_response(outputs), flags=FINAL if response.is_final else 0)
        except Exception:  # the client is gone: stop spending steps on it
            if not response.is_final:
                self.executor.cancel_request(response.request_id)

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
        with self.lock:
            leftovers, self.active = list(self.active.values()), {}
        for active in leftovers:
            try:
                send_error(active.sender, "tensorrt_llm: the model is shutting down")
            except Exception:
                pass

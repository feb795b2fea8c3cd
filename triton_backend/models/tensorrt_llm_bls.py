"""The `tensorrt_llm_bls` Triton model: preprocessing, generation and postprocessing in one hop.

Tokenization and detokenization run in-process; generation goes through the `tensorrt_llm`
model with a BLS call, so both entry points share one executor (and its KV cache and batch).
`execute` hands each request to a worker thread and returns None; a worker streams its inner
request and sends the text chunks (FINAL on the last). One watcher thread looks for cancelled
clients (`CancelWatch`) and sends the inner model a `stop` request with the inner request's id
(NVIDIA's cancellation convention).
"""
from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from triton_backend.engine.config import EngineConfig
from triton_backend.models.detokenizer import IncrementalDetokenizer, stop_strings_of
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import RequestError, check_output_len, scalar
from triton_backend.models.response_converter import (ERROR_AS_OUTPUT, ERROR_OUTPUT,
                                                      PERF_METRIC_OUTPUTS)
from triton_backend.models.text_request import (LORA_ARRAY_INPUTS, PASSTHROUGH_INPUTS,
                                                 encode_words, prompt_ids,
                                                 tensorrt_llm_inputs, text_list, text_value)
from triton_backend.models.triton_io import (FINAL, limit_compute_threads, make_response,
                                              read_inputs, send_error, stop_request)

INPUT_NAMES = ("text_input", "max_tokens", "bad_words", "stop_words", "stream",
               "apply_chat_template", *PASSTHROUGH_INPUTS, *LORA_ARRAY_INPUTS)
PASSED_OUTPUTS = ("cum_log_probs", "batch_index", "sequence_index", "num_input_tokens",
                  "num_output_tokens", "arrival_time_ns", "first_token_time_ns",
                  "last_token_time_ns", "finish_reason", *PERF_METRIC_OUTPUTS)
# ERROR_OUTPUT: with the ERROR_AS_OUTPUT parameter, the inner model ends a failed request with
# its message there, a response that reaches this model's stream even after text has streamed
# (an error response would not).
INNER_OUTPUTS = ("output_ids", "output_log_probs", ERROR_OUTPUT, *PASSED_OUTPUTS)
CHECK_SECONDS = 0.1  # how often the clients of requests in flight are asked if they cancelled


def _is_cancelled(sender) -> bool:
    try:
        return bool(sender.is_cancelled())
    except Exception:  # the stub could not ask: the request's end says what happened
        return False


class CancelWatch:
    """Stops the inner request of every request whose client cancelled, checked on a timer and
    not on the inner request's chunks: a request still waiting for a batch slot (or a
    non-streamed one) has no chunk to check on, and would keep its place until it ran.

    A sender is asked only while it is watched, under the lock `forget` takes: a worker forgets
    its request before it sends the final response, after which Triton frees the response
    factory the sender would ask (asking then crashes tritonserver)."""

    def __init__(self, inner_model: str) -> None:
        self.inner_model = inner_model
        self._lock = threading.Lock()
        self._watched: dict[str, object] = {}  # inner request id -> the client's sender
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bls-cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, inner_id: str, sender) -> None:
        with self._lock:
            self._watched[inner_id] = sender

    def forget(self, inner_id: str) -> None:
        """From its return on, `inner_id`'s sender is never asked again."""
        with self._lock:
            self._watched.pop(inner_id, None)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closing.wait(CHECK_SECONDS):
            with self._lock:
                cancelled = [inner_id for inner_id, sender in self._watched.items()
                             if _is_cancelled(sender)]
                for inner_id in cancelled:  # once: the inner model ends it with a final
                    del self._watched[inner_id]
            for inner_id in cancelled:
                stop_request(self.inner_model, inner_id)


@dataclass(frozen=True)
class InnerChunk:
    """One response of the inner `tensorrt_llm` request, read once."""

    ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "" until the last
    passed: dict[str, np.ndarray]  # the PASSED_OUTPUTS it carries, relayed as they are

    @classmethod
    def read(cls, outputs: dict[str, np.ndarray]) -> InnerChunk | str | None:
        """The chunk; the error message when the inner request failed (`ERROR_OUTPUT`); None for
        an empty closing response."""
        if ERROR_OUTPUT in outputs:
            return outputs[ERROR_OUTPUT].reshape(-1)[0].decode("utf-8", "replace")
        if "output_ids" not in outputs:
            return None
        return cls(ids=outputs["output_ids"].reshape(-1).tolist(),
                   log_probs=outputs["output_log_probs"].reshape(-1).tolist(),
                   finish_reason=outputs["finish_reason"].reshape(-1)[0].decode(),
                   passed={name: outputs[name] for name in PASSED_OUTPUTS if name in outputs})


@dataclass
class Reply:
    """Text, log probs and ids to send: one chunk's (streamed) or all of them gathered."""

    pieces: list[str] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def add(self, text: str, chunk: InnerChunk) -> None:
        self.pieces.append(text)
        self.log_probs.extend(chunk.log_probs)
        self.ids.extend(chunk.ids)

    def tensors(self) -> dict[str, np.ndarray]:
        n = len(self.ids)
        return {"text_output": np.asarray([["".join(self.pieces).encode("utf-8")]], dtype=object),
                "output_log_probs": np.asarray(self.log_probs, np.float32).reshape(
                    1, 1, len(self.log_probs)),
                "output_ids": np.asarray(self.ids, dtype=np.int32).reshape(1, 1, n)}


class BlsModel:
    def initialize(self, args):
        limit_compute_threads()
        params = ModelParams(args)
        self.decoupled = params.decoupled
        self.limits = EngineConfig.load(params.path("engine_dir")).limits
        self.tokenizer = AutoTokenizer.from_pretrained(str(params.path("tokenizer_dir")))
        self.add_special_tokens = params.flag("add_special_tokens", True)
        self.skip_special_tokens = params.flag("skip_special_tokens", True)
        self.inner_model = params.text("tensorrt_llm_model_name", "tensorrt_llm")
        self.workers = ThreadPoolExecutor(params.integer("max_concurrent_requests", 64),
                                          thread_name_prefix="bls")
        self.cancels = CancelWatch(self.inner_model)
        self.closing = False

    def execute(self, requests):
        for request in requests:
            self.workers.submit(self._serve, request, request.get_response_sender())
        return None

    def finalize(self):
        # Every request gets its end before this process exits: those running relay their inner
        # request's last response (the tensorrt_llm model ends all of them when it stops);
        # those still queued are answered with an error at once.
        self.closing = True
        self.workers.shutdown(wait=True)
        self.cancels.close()

    # -- one request, in a worker thread ------------------------------------------------------
    def _serve(self, request, sender) -> None:
        if self.closing:
            send_error(sender, "tensorrt_llm_bls: the model is shutting down; the request was "
                               "not started")
            return
        try:
            inputs = read_inputs(request, INPUT_NAMES)
            stream = bool(scalar(inputs, "stream") or False)
            if stream and not self.decoupled:
                raise RequestError("stream needs the decoupled tensorrt_llm_bls model; this "
                                   "repository was emitted with decoupled: false")
            inner, detokenizer = self._inner_request(inputs, request.timeout())
            self._relay(inner, detokenizer, sender, stream)
        except RequestError as exc:
            send_error(sender, str(exc))
        except Exception as exc:  # keep serving everyone else; tell this client why
            send_error(sender, f"tensorrt_llm_bls: {type(exc).__name__}: {exc}")

    def _inner_request(self, inputs: dict, timeout_us: int):
        ids = prompt_ids(self.tokenizer, text_value(inputs, "text_input", "text_input"),
                         self.add_special_tokens, self.limits,
                         bool(scalar(inputs, "apply_chat_template") or False))
        max_tokens = check_output_len(scalar(inputs, "max_tokens"), len(ids), self.limits)
        stop = encode_words(self.tokenizer, text_list(inputs, "stop_words", "stop_words"),
                            "stop_words")
        bad = encode_words(self.tokenizer, text_list(inputs, "bad_words", "bad_words"),
                           "bad_words")
        # The inner request streams whenever it can: chunks are where cancellation is checked.
        tensors = tensorrt_llm_inputs(inputs, ids, max_tokens, stop, bad,
                                      streaming=self.decoupled)
        inner = pb_utils.InferenceRequest(
            model_name=self.inner_model, request_id=f"bls-{uuid.uuid4().hex}",
            inputs=[pb_utils.Tensor(name, value) for name, value in tensors.items()],
            requested_output_names=list(INNER_OUTPUTS),
            parameters={ERROR_AS_OUTPUT: True},
            timeout=timeout_us)  # Triton's request timeout (us, 0: none) carries on inside
        # Stop strings as the ensemble's postprocessing sees them: the text of the stop ids.
        stop_strings = stop_strings_of(self.tokenizer, stop, self.skip_special_tokens)
        detokenizer = IncrementalDetokenizer(self.tokenizer, stop_strings,
                                             self.skip_special_tokens)
        return inner, detokenizer

    def _relay(self, inner, detokenizer, sender, stream: bool) -> None:
        inner_id = inner.request_id()
        self.cancels.watch(inner_id, sender)
        try:
            self._relay_chunks(inner, detokenizer, sender, stream,
                               lambda: self.cancels.forget(inner_id))
        finally:
            self.cancels.forget(inner_id)

    def _relay_chunks(self, inner, detokenizer, sender, stream: bool, ending) -> None:
        """Relay the inner request's chunks; `ending()` is called before the final response."""
        reply = Reply()
        responses = inner.exec(decoupled=True) if self.decoupled else [inner.exec()]
        for response in responses:
            if response.has_error():
                ending()
                send_error(sender, response.error().message())
                return
            chunk = InnerChunk.read({t.name(): t.as_numpy() for t in response.output_tensors()})
            if isinstance(chunk, str):
                ending()
                send_error(sender, chunk)
                return
            if chunk is None:
                continue  # an empty closing response
            text = detokenizer.add(chunk.ids, chunk.finish_reason)
            final = bool(chunk.finish_reason)
            if final:
                ending()
            if stream:
                self._send(sender, Reply([text], chunk.log_probs, chunk.ids), chunk.passed, final)
            else:
                reply.add(text, chunk)
                if final:
                    self._send(sender, reply, chunk.passed, True)
            if final:
                return
        # Never a stream without its end, even if the inner one stopped short of a final answer.
        ending()
        send_error(sender, "tensorrt_llm_bls: the tensorrt_llm stream ended without a final "
                           "response")

    def _send(self, sender, reply: Reply, passed: dict[str, np.ndarray], final: bool) -> None:
        try:
            sender.send(make_response({**passed, **reply.tensors()}), flags=FINAL if final else 0)
        except Exception:
            pass  # the client went away; the cancel watch stops the inner request

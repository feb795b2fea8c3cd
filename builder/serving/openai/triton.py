"""Generation over Triton's gRPC streaming API, from asyncio (tritonclient's aio client): to the
`tensorrt_llm` model with token ids (`direct.py` tokenizes and detokenizes here), or to the
`ensemble` / `tensorrt_llm_bls` with text.

One gRPC stream per OpenAI request on one shared channel; the stream's sending half stays open
until the request ends. A request abandoned before its last chunk (the HTTP client went away)
is cancelled twice over: its gRPC call is cancelled, which `tensorrt_llm_bls` sees through its
response sender, and the `tensorrt_llm` model gets a `stop` request with the same request id
(NVIDIA's convention), because Triton 2.51 does not pass an ensemble's cancellation on to the
ensemble's steps. Either way its KV blocks are freed within a step.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np
from tritonclient.grpc import InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from builder.client import text_inputs
from builder.client.grpc_stream import infer_inputs
from builder.serving.openai.direct import (DIRECT_LOG_PROB_OUTPUTS, DIRECT_OUTPUTS,
                                           DIRECT_TOP_OUTPUTS, RequestError, TextCodec,
                                           direct_request)
from builder.serving.openai.errors import (OpenAIError, draining, from_triton, internal,
                                           not_ready)
from triton_backend.models.serving_control import STOP_REQUEST_INPUTS

BASE_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
GENERATION_MODEL = "tensorrt_llm"  # the ensemble's step that holds the request's KV blocks
LOG_PROB_OUTPUTS = ("output_log_probs", "output_ids")


@dataclass
class Chunk:
    """One response of the ensemble: the new text and, on the last one, the finish reason."""

    text: str
    finish_reason: str  # "" until the last chunk
    num_input_tokens: int
    num_output_tokens: int
    log_probs: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # per token, when top log probs were asked for: [(token id, log prob), ...] most likely first
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _first(array: np.ndarray | None, default=0):
    if array is None or array.size == 0:
        return default
    return array.reshape(-1)[0]


def _chunk(result) -> Chunk:
    reason = _first(result.as_numpy("finish_reason"), b"")
    log_probs = result.as_numpy("output_log_probs")
    token_ids = result.as_numpy("output_ids")
    return Chunk(
        text=b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8"),
        finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
        num_input_tokens=int(_first(result.as_numpy("num_input_tokens"))),
        num_output_tokens=int(_first(result.as_numpy("num_output_tokens"))),
        log_probs=[] if log_probs is None else log_probs.reshape(-1).tolist(),
        token_ids=[] if token_ids is None else token_ids.reshape(-1).tolist())


def _direct_chunk(result, detokenizer) -> Chunk:
    """A `tensorrt_llm` response as the ensemble's chunk would read (text detokenized here)."""
    reason = _first(result.as_numpy("finish_reason"), b"")
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    token_ids = result.as_numpy("output_ids")
    token_ids = [] if token_ids is None else token_ids.reshape(-1).tolist()
    log_probs = result.as_numpy("output_log_probs")
    return Chunk(text=detokenizer.add(token_ids, reason), finish_reason=reason,
                 num_input_tokens=int(_first(result.as_numpy("num_input_tokens"))),
                 num_output_tokens=int(_first(result.as_numpy("num_output_tokens"))),
                 log_probs=[] if log_probs is None else log_probs.reshape(-1).tolist(),
                 token_ids=token_ids, top=_top(result))


def _top(result) -> list[list[tuple[int, float]]]:
    ids, values = result.as_numpy("output_top_ids"), result.as_numpy("output_top_log_probs")
    if ids is None or values is None or ids.size == 0:
        return []
    ids, values = ids.reshape(ids.shape[-2], ids.shape[-1]), values.reshape(ids.shape[-2], -1)
    return [list(zip(map(int, row), map(float, vals))) for row, vals in zip(ids, values)]


def _tensors(values: dict[str, object]) -> list:
    return infer_inputs(text_inputs(**values))


class TritonBackend:
    """Generation requests to one Triton model (the ensemble or tensorrt_llm_bls).

    Create it inside the event loop that uses it (gRPC aio channels belong to one loop).
    """

    def __init__(self, url: str, model: str, request_timeout_s: float,
                 codec: TextCodec | None = None) -> None:
        if model == GENERATION_MODEL and codec is None:
            raise ValueError("the tensorrt_llm model takes token ids: a TextCodec is required")
        self.url, self.model, self.codec = url, model, codec
        self.request_timeout_s = request_timeout_s
        self.client = InferenceServerClient(url)
        self._stops: set[asyncio.Task] = set()  # stop requests in flight (keeps them alive)

    async def is_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready()
                        and await self.client.is_model_ready(self.model))
        except InferenceServerException:
            return False

    async def generate(self, values: dict[str, object], request_id: str, prompt_field: str,
                       log_probs: bool = False) -> AsyncIterator[Chunk]:
        """The request's chunks, the last one with a finish reason; raises `OpenAIError`.

        Closing the generator before its last chunk cancels the request in Triton.
        """
        request, to_chunk = self._request(values, request_id, prompt_field, log_probs)
        done = asyncio.Event()

        async def requests():
            yield request
            await done.wait()  # keep the sending half open until the request ends

        call = self.client.stream_infer(requests(), stream_timeout=self.request_timeout_s)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise from_triton(error.message(), prompt_field)
                chunk = to_chunk(result)
                finished = bool(chunk.finish_reason)
                if chunk.finish_reason == "cancelled" and not await self.is_ready():
                    # Not our cancel (that closes this generator): the drain's cut, as the
                    # ensemble ends it (serving_control.py), or a server going away.
                    raise draining("the server is draining: the request was cut at the drain "
                                   "timeout; send it again")
                yield chunk
                if finished:
                    return
            raise internal("Triton closed the stream before the last response")
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from None
        finally:
            done.set()
            if not finished:
                call.cancel()
                if self.model in ("ensemble", GENERATION_MODEL):
                    task = asyncio.ensure_future(self._stop(request_id))
                    self._stops.add(task)
                    task.add_done_callback(self._stops.discard)

    def _request(self, values: dict[str, object], request_id: str, prompt_field: str,
                 log_probs: bool):
        """The stream request for `values` and the function reading its responses."""
        if self.model != GENERATION_MODEL:
            names = BASE_OUTPUTS + (LOG_PROB_OUTPUTS if log_probs else ())
            inputs = _tensors(values)
            to_chunk = _chunk
        else:
            try:
                direct = direct_request(self.codec, values)
            except RequestError as exc:
                raise from_triton(str(exc), prompt_field) from None
            names = DIRECT_OUTPUTS + (DIRECT_LOG_PROB_OUTPUTS if log_probs else ())
            if values.get("top_log_probs"):
                names += DIRECT_TOP_OUTPUTS
            inputs = infer_inputs(direct.tensors)
            to_chunk = lambda result: _direct_chunk(result, direct.detokenizer)  # noqa: E731
        request = {"model_name": self.model, "inputs": inputs, "request_id": request_id,
                   "outputs": [InferRequestedOutput(name) for name in names]}
        return request, to_chunk

    async def _stop(self, request_id: str) -> None:
        """`stop: true` with the request's id cancels it in the tensorrt_llm model."""
        tensors = infer_inputs({name: np.array([[value]], np.bool_ if name == "stop" else np.int32)
                                for name, value in STOP_REQUEST_INPUTS.items()})

        async def requests():
            yield {"model_name": GENERATION_MODEL, "inputs": tensors, "request_id": request_id}

        try:  # its one (empty) answer may never come back as a response: bound the wait
            call = self.client.stream_infer(requests(), stream_timeout=10.0)
            async for _ in call:
                break
        except (grpc.aio.AioRpcError, InferenceServerException, asyncio.TimeoutError):
            pass  # the request ended by itself meanwhile, or Triton is gone: nothing to free

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> OpenAIError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return not_ready(f"Triton at {self.url} is not reachable: {exc.details()}")
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return internal(f"the request did not finish within {self.request_timeout_s:g}s")
        return internal(f"Triton stream failed: {exc.code().name}: {exc.details()}")

    async def close(self) -> None:
        for task in list(self._stops):
            task.cancel()
        await self.client.close()

"""Executor `Response` -> `tensorrt_llm` output tensors (NVIDIA's names and shapes). Pure.

Every output has the batch dimension first (batch 1) and, where NVIDIA has one, a beam
dimension (beam 1): `output_ids` [1, 1, L], `sequence_length` [1, 1], ... Streaming responses
carry only the new tokens; `preceding_output_ids` carries a window of the tokens streamed before
them and `stop_words_ids` echoes the request's stop words, so the stateless `postprocessing`
model can continue the text exactly and trim stop strings (a Triton ensemble step cannot take
inputs both from the request and from a decoupled model, so they travel through this model).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from triton_backend.engine.request import Response
from triton_backend.models.detokenizer import PRECEDING_WINDOW
from triton_backend.models.word_list import to_word_list

# NVIDIA's per-request performance outputs (return_perf_metrics): the prefix cache's reuse and
# speculative decoding's acceptance, as of this response.
PERF_METRIC_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                       "kv_cache_alloc_total_blocks", "acceptance_rate",
                       "total_accepted_draft_tokens", "total_draft_tokens")

# Our BLS sets this request parameter (true): its request then ends with an error as a FINAL
# response carrying the message in ERROR_OUTPUT, not as an error response. Triton (2.51) does
# not deliver an error response to a BLS caller's stream once that stream has had a response,
# which would leave the BLS client waiting forever.
ERROR_AS_OUTPUT = "llm_forge_error_as_output"
ERROR_OUTPUT = "error_message"


def error_outputs(message: str) -> dict[str, np.ndarray]:
    return {ERROR_OUTPUT: np.asarray([[message.encode("utf-8")]], dtype=object)}


@dataclass
class StreamState:
    """What the model remembers about one running request between its responses."""

    input_ids: list[int]
    exclude_input_in_output: bool = True
    arrival_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    streamed_ids: list[int] = field(default_factory=list)
    input_sent: bool = False
    stop_words: list[list[int]] = field(default_factory=list)
    cancel_key: str = ""  # the tensorrt_llm model's key for `stop` requests ("": none given out)


def coalesce(responses: list[Response]) -> list[Response]:
    """Merge the responses of one request that wait together into one: its tokens in order, the
    counters of the latest. When the model falls behind the engine (a burst of short steps, a
    busy machine), every send it saves is an IPC to Triton it no longer makes. An error response
    is never merged (the tokens before it go out first); order across requests is kept."""
    merged: list[Response] = []
    latest: dict[int, int] = {}  # request id -> index in `merged` of its newest open response
    for response in responses:
        index = latest.get(response.request_id)
        if index is not None and not response.has_error:
            before = merged[index]
            merged[index] = dataclasses.replace(
                response, output_token_ids=before.output_token_ids + response.output_token_ids,
                log_probs=before.log_probs + response.log_probs,
                top_ids=before.top_ids + response.top_ids,
                top_log_probs=before.top_log_probs + response.top_log_probs)
        else:
            merged.append(response)
            index = len(merged) - 1
        if response.is_final:
            latest.pop(response.request_id, None)
        else:
            latest[response.request_id] = index
    return merged


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def _one(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


def build_outputs(response: Response, state: StreamState, now_ns: int,
                  wanted: frozenset[str] | None = None) -> dict[str, np.ndarray]:
    """Output tensors for one executor response; advances `state` past it.

    With `exclude_input_in_output` false the prompt ids lead the first response's `output_ids`.
    `finish_reason` is "" while more responses follow and the executor's reason on the last one.
    `wanted` (the request's requested outputs; None: all) limits what is built: a streamed token
    costs a tensor per output, and the ensemble or a client may ask for only a few.
    """
    tokens = [int(t) for t in response.output_token_ids]
    if tokens:
        state.first_token_time_ns = state.first_token_time_ns or now_ns
        state.last_token_time_ns = now_ns
    log_probs = list(response.log_probs) if response.log_probs else [0.0] * len(tokens)
    top_ids, top_log_probs = list(response.top_ids), list(response.top_log_probs)
    if not state.exclude_input_in_output and not state.input_sent:
        tokens = list(state.input_ids) + tokens
        log_probs = [0.0] * len(state.input_ids) + log_probs
        if top_ids:  # prompt tokens have no alternatives: ids -1, log probs 0
            k = len(top_ids[0])
            top_ids = [[-1] * k] * len(state.input_ids) + top_ids
            top_log_probs = [[0.0] * k] * len(state.input_ids) + top_log_probs
    state.input_sent = True
    preceding = state.streamed_ids[-PRECEDING_WINDOW:]
    state.streamed_ids.extend(tokens)
    reason = ""
    if response.is_final:
        reason = response.finish_reason.value if response.finish_reason else "length"
    makers = {
        "output_ids": lambda: _i32(tokens).reshape(1, 1, len(tokens)),
        "sequence_length": lambda: _i32([[len(tokens)]]),
        "cum_log_probs": lambda: np.asarray([[response.cum_log_prob]], dtype=np.float32),
        "output_log_probs": lambda: np.asarray(log_probs, dtype=np.float32).reshape(
            1, 1, len(tokens)),
        "output_top_ids": lambda: _i32(top_ids).reshape(1, len(top_ids), -1 if top_ids else 0),
        "output_top_log_probs": lambda: np.asarray(top_log_probs, dtype=np.float32).reshape(
            1, len(top_log_probs), -1 if top_log_probs else 0),
        "batch_index": lambda: _one(0, np.int32),
        "sequence_index": lambda: _one(0, np.int32),
        "num_input_tokens": lambda: _one(response.num_input_tokens or len(state.input_ids),
                                         np.int32),
        "num_output_tokens": lambda: _one(response.num_output_tokens, np.int32),
        "arrival_time_ns": lambda: _one(state.arrival_time_ns, np.int64),
        "first_token_time_ns": lambda: _one(state.first_token_time_ns, np.int64),
        "last_token_time_ns": lambda: _one(state.last_token_time_ns, np.int64),
        "finish_reason": lambda: np.asarray([[reason.encode()]], dtype=object),
        "preceding_output_ids": lambda: _i32(preceding).reshape(1, len(preceding)),
        "stop_words_ids": lambda: to_word_list(state.stop_words)[None],
        "cancel_key": lambda: np.asarray([[state.cancel_key.encode()]], dtype=object),
        "kv_cache_alloc_new_blocks": lambda: _one(response.num_new_blocks, np.int32),
        "kv_cache_reused_blocks": lambda: _one(response.num_reused_blocks, np.int32),
        "kv_cache_alloc_total_blocks": lambda: _one(
            response.num_new_blocks + response.num_reused_blocks, np.int32),
        "acceptance_rate": lambda: _one(response.num_accepted_draft_tokens
                                        / max(1, response.num_draft_tokens), np.float32),
        "total_accepted_draft_tokens": lambda: _one(response.num_accepted_draft_tokens, np.int32),
        "total_draft_tokens": lambda: _one(response.num_draft_tokens, np.int32),
    }
    return {name: make() for name, make in makers.items() if wanted is None or name in wanted}

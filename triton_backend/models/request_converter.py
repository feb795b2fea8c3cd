"""`tensorrt_llm` model inputs (NVIDIA's tensor names) -> an executor `Request`. Pure.

Inputs arrive as numpy arrays with Triton's batch dimension first. One Triton request carries one
sequence (batch 1); concurrent sequences come as concurrent requests, which the executor batches.
Every problem is a `RequestError` naming the wire field and the limit; inputs we cannot honour
(beam search, several return sequences, a length penalty) are refused, never ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from triton_backend.engine.config import Limits
from triton_backend.engine.guided import GuidedDecodingParams
from triton_backend.engine.numbers import is_int
from triton_backend.engine.request import (MAX_TIMEOUT_MS, MAX_TOP_LOG_PROBS, PRIORITY_MAX,
                                           PRIORITY_MIN, Request)
from triton_backend.engine.sampling_params import SamplingParams
from triton_backend.engine.validation import check_max_tokens, check_word_limits
from triton_backend.models.word_list import from_word_list

# SamplingParams field -> the tensorrt_llm input that carries it.
# Every input of the `tensorrt_llm` model that `parse_request` reads.
INPUT_NAMES = (
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
    "bad_words_list", "beam_width", "num_return_sequences", "temperature", "runtime_top_k",
    "runtime_top_p", "len_penalty", "repetition_penalty", "min_tokens", "presence_penalty",
    "frequency_penalty", "seed", "return_log_probs", "return_perf_metrics",
    "return_num_input_tokens", "return_num_output_tokens", "exclude_input_in_output", "stop",
    "streaming", "timeout_ms", "priority", "guided_decoding_guide_type", "guided_decoding_guide",
    "top_log_probs", "lora_task_id", "lora_weights", "lora_config")
SAMPLING_INPUTS = {
    "temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "min_tokens": "min_tokens", "seed": "seed",
}


class RequestError(ValueError):
    """A request the model refuses; the message names the field and the limit."""


@dataclass(frozen=True)
class RequestDefaults:
    """Repository-level defaults for inputs a request leaves out (config.pbtxt parameters)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    exclude_input_in_output: bool = True


@dataclass
class ParsedRequest:
    """What the `tensorrt_llm` model needs to run and answer one Triton request."""

    request: Request | None  # None for a `stop` request
    stop: bool = False
    exclude_input_in_output: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    input_ids: list[int] = field(default_factory=list)


def scalar(inputs: Mapping[str, np.ndarray], name: str):
    """The single value of an optional scalar input, or None when absent."""
    array = inputs.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value per request, "
                           f"got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


def integer(inputs: Mapping[str, np.ndarray], name: str):
    """The single value of an optional integer input as an int (None when absent); a float that
    is not a whole number (NaN, inf, 2.5) is refused naming the input."""
    value = scalar(inputs, name)
    if value is None or isinstance(value, bool):
        return value
    return as_integer(value, name)


def as_integer(value, name: str) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise RequestError(f"{name} must be an integer, got {value!r}")


def _flag(inputs: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    value = scalar(inputs, name)
    return default if value is None else bool(value)


def _input_ids(inputs: Mapping[str, np.ndarray], vocab_size: int) -> list[int]:
    array = inputs.get("input_ids")
    if array is None:
        raise RequestError("input_ids is required")
    array = np.asarray(array)
    if array.ndim == 2 and array.shape[0] != 1:
        raise RequestError(f"input_ids: batch size must be 1 per request, got {array.shape[0]} "
                           "(send concurrent requests instead)")
    if array.dtype.kind not in "iu":
        raise RequestError(f"input_ids must be integer token ids, got dtype {array.dtype}")
    ids = [int(i) for i in array.reshape(-1)]
    length = integer(inputs, "input_lengths")
    if length is not None:
        if not 0 <= length <= len(ids):
            raise RequestError(f"input_lengths ({length}) must be within 0..{len(ids)} "
                               "(the number of input_ids)")
        ids = ids[:length]
    if not ids:
        raise RequestError("input_ids must hold at least one token (empty prompt)")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"input_ids: token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab_size})")
    return ids


def check_output_len(max_tokens, num_input: int, limits: Limits, field: str = "max_tokens") -> int:
    """`validation.check_max_tokens` on an input (a whole float is an int), as a RequestError."""
    try:
        if max_tokens is not None and not isinstance(max_tokens, bool):
            max_tokens = as_integer(max_tokens, field)
        return check_max_tokens(max_tokens, num_input, limits, field)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _refuse_unsupported(inputs: Mapping[str, np.ndarray]) -> None:
    beam_width = scalar(inputs, "beam_width")
    if beam_width is not None and beam_width != 1:
        raise RequestError(f"beam_width must be 1 (beam search is not supported), got {beam_width}")
    num_sequences = scalar(inputs, "num_return_sequences")
    if num_sequences is not None and num_sequences != 1:
        raise RequestError(f"num_return_sequences must be 1, got {num_sequences}")
    len_penalty = scalar(inputs, "len_penalty")
    if len_penalty is not None and len_penalty != 1.0:
        raise RequestError(f"len_penalty (length_penalty) only applies to beam search, which is "
                           f"not supported: must be 1.0, got {len_penalty}")


def _sampling(inputs: Mapping[str, np.ndarray], defaults: RequestDefaults) -> SamplingParams:
    values = {"temperature": defaults.temperature, "top_k": defaults.top_k,
              "top_p": defaults.top_p}
    for param, wire in SAMPLING_INPUTS.items():
        value = scalar(inputs, wire)
        if value is not None:
            values[param] = value
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        message = str(exc)
        for param, wire in SAMPLING_INPUTS.items():
            if message.startswith(param + " ") and wire != param:
                message = f"{wire} ({param}){message[len(param):]}"
                break
        raise RequestError(message) from None


def _bounded_integer(inputs: Mapping[str, np.ndarray], name: str, low: int, high: int,
                     meaning: str = "") -> int | None:
    value = integer(inputs, name)
    if value is not None and (not is_int(value) or not low <= value <= high):
        raise RequestError(f"{name} must be an integer in [{low}, {high}]{meaning}, "
                           f"got {value!r}")
    return value


def _deadline(inputs: Mapping[str, np.ndarray], request_timeout_us: int) -> tuple[int | None, str]:
    """(timeout in ms or None, the field that set it): the `timeout_ms` input (0: none) or
    Triton's own request timeout (microseconds, 0: none), whichever ends first."""
    timeout_ms = _bounded_integer(inputs, "timeout_ms", 0, MAX_TIMEOUT_MS, " (0: no deadline)")
    candidates = []
    if timeout_ms:
        candidates.append((timeout_ms, "timeout_ms"))
    if request_timeout_us and request_timeout_us > 0:
        candidates.append((min(-(-request_timeout_us // 1000), MAX_TIMEOUT_MS), "timeout"))
    return min(candidates) if candidates else (None, "timeout_ms")


def _string(inputs: Mapping[str, np.ndarray], name: str) -> str | None:
    value = scalar(inputs, name)
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, bytes):  # np.bytes_ is bytes; a number is not text
        raise RequestError(f"{name} must be UTF-8 text (a BYTES input), got {value!r}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(f"{name} must be UTF-8 text") from None


def _guided_decoding(inputs: Mapping[str, np.ndarray]) -> GuidedDecodingParams | None:
    """NVIDIA's guided decoding inputs; a guide without its type is refused (it would be
    ignored), a type without a guide is `json` (any JSON) or refused naming the guide."""
    guide_type = _string(inputs, "guided_decoding_guide_type")
    guide = _string(inputs, "guided_decoding_guide")
    if guide_type is None or guide_type == "":
        if guide:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type (json, "
                               "json_schema, regex or ebnf_grammar)")
        return None
    try:
        return GuidedDecodingParams(guide_type, guide or "")
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _lora(inputs: Mapping[str, np.ndarray]) -> dict:
    """NVIDIA's LoRA inputs: `lora_task_id` names an adapter; `lora_weights` + `lora_config` (with
    it) load one under that id. Whether the engine knows the id is the engine's check."""
    task_id = integer(inputs, "lora_task_id")
    weights, config = inputs.get("lora_weights"), inputs.get("lora_config")
    if task_id is None:
        if weights is not None or config is not None:
            raise RequestError("lora_weights/lora_config need a lora_task_id to cache them under")
        return {}
    if not is_int(task_id) or not 0 <= task_id < 2**64:
        raise RequestError(f"lora_task_id must be an integer in [0, 2^64), got {task_id!r}")
    if (weights is None) != (config is None):
        raise RequestError(f"lora_task_id {task_id}: lora_weights and lora_config come "
                           f"together ({'lora_config' if config is None else 'lora_weights'} "
                           f"is missing)")
    if weights is not None:
        weights, config = np.asarray(weights), np.asarray(config)
        if weights.dtype.kind not in "fiu" or weights.ndim not in (2, 3):
            raise RequestError(f"lora_weights must be a [N, D*Hi + Ho*D] array of numbers, got "
                               f"{weights.dtype} of shape {list(weights.shape)}")
        if config.dtype.kind not in "iu" or config.ndim not in (2, 3) or config.shape[-1] != 3:
            raise RequestError(f"lora_config must be an [N, 3] integer array, got "
                               f"{config.dtype} of shape {list(config.shape)}")
        # fp16 on the wire (NVIDIA's TYPE_FP16); computed in float32/bf16 on a CPU
        weights, config = weights.astype(np.float32), config.astype(np.int64)
    return {"lora_task_id": task_id, "lora_weights": weights, "lora_config": config}


NO_END_ID = -1


def parse_request(inputs: Mapping[str, np.ndarray], limits: Limits, vocab_size: int,
                  defaults: RequestDefaults = RequestDefaults(), *,
                  arrival_time_ns: int | None = None,
                  request_timeout_us: int = 0) -> ParsedRequest:
    """Validate the inputs of one `tensorrt_llm` request and build the executor request.
    `arrival_time_ns`: when it reached the server (wall clock); `request_timeout_us`: Triton's
    own request timeout (`InferenceRequest.timeout()`, 0: none)."""
    if _flag(inputs, "stop", False):
        return ParsedRequest(request=None, stop=True)
    _refuse_unsupported(inputs)
    ids = _input_ids(inputs, vocab_size)
    if len(ids) > limits.max_input_len:
        raise RequestError(f"input_ids: prompt has {len(ids)} tokens, over the engine's "
                           f"max_input_len {limits.max_input_len}")
    max_tokens = check_output_len(scalar(inputs, "request_output_len"), len(ids), limits,
                                  "request_output_len (max_tokens)")
    end_id = integer(inputs, "end_id")
    words = {}
    for name in ("stop_words_list", "bad_words_list"):
        try:
            words[name] = ([] if inputs.get(name) is None
                           else from_word_list(inputs[name], name))
            check_word_limits(name, words[name])
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        outside = [t for word in words[name] for t in word if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(f"{name}: token id {outside[0]} is outside the vocabulary "
                               f"[0, {vocab_size})")
    timeout_ms, timeout_field = _deadline(inputs, request_timeout_us)
    priority = _bounded_integer(inputs, "priority", PRIORITY_MIN, PRIORITY_MAX)
    top_log_probs = _bounded_integer(inputs, "top_log_probs", 0, MAX_TOP_LOG_PROBS)
    request = Request(
        input_token_ids=ids, max_tokens=max_tokens, sampling=_sampling(inputs, defaults),
        streaming=_flag(inputs, "streaming", False),
        # -1: no end id at all (TensorRT-LLM's benchmarks' way to ignore EOS)
        end_ids=None if end_id is None or end_id == NO_END_ID else [int(end_id)],
        ignore_eos=end_id == NO_END_ID,
        stop_token_sequences=words["stop_words_list"], bad_token_sequences=words["bad_words_list"],
        return_log_probs=_flag(inputs, "return_log_probs", False),
        priority=priority or 0, arrival_time_ns=arrival_time_ns, timeout_ms=timeout_ms,
        timeout_field=timeout_field, guided_decoding=_guided_decoding(inputs),
        top_log_probs=top_log_probs or 0, **_lora(inputs))
    return ParsedRequest(
        request=request,
        exclude_input_in_output=_flag(inputs, "exclude_input_in_output",
                                      defaults.exclude_input_in_output),
        return_num_input_tokens=_flag(inputs, "return_num_input_tokens", False),
        return_num_output_tokens=_flag(inputs, "return_num_output_tokens", False),
        return_perf_metrics=_flag(inputs, "return_perf_metrics", False),
        input_ids=ids)

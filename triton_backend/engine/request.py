"""What goes into the executor (`Request`) and what comes out (`Response`).

The verbs and shapes mirror TensorRT-LLM's executor so that the `tensorrt_llm` Triton model can
drive either engine: a request is enqueued, responses are awaited, the last one has `is_final`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from triton_backend.engine.guided.params import GuidedDecodingParams
from triton_backend.engine.sampling_params import SamplingParams


PRIORITY_MIN, PRIORITY_MAX = -100, 100
MAX_TOP_LOG_PROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
MAX_TIMEOUT_MS = 24 * 3600 * 1000  # a deadline further away than a day is a mistake


class FinishReason(str, enum.Enum):
    LENGTH = "length"          # max_tokens reached (or max_seq_len)
    END_ID = "end_id"          # an end-of-sequence id was generated
    STOP_WORDS = "stop_words"  # a stop token sequence was generated (it is part of the output)
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Request:
    """One generation request, in token ids.

    `end_ids` None means the engine's own end-of-sequence ids (every EOS id of the checkpoint);
    an empty list means "never stop on an id". Stop and bad sequences are lists of token ids.

    Scheduling: `priority` in [PRIORITY_MIN, PRIORITY_MAX], higher is admitted first and
    preempted last (see `WaitingQueue` for the aging that bounds a low priority's wait).
    `arrival_time_ns` (wall clock, so it means the same in every process) is when the request
    reached the server; None: when the engine receives it. With `timeout_ms` the request ends
    with an error naming `timeout_field` once `timeout_ms` have passed since its arrival,
    waiting or running.

    `top_log_probs`: how many alternatives (the most likely tokens and their log probs) to
    return per generated token, from the model's raw distribution (before penalties,
    temperature, masks); with it, the tokens' own log probs are the raw ones too.

    `guided_decoding`: a grammar the output must follow (JSON, a JSON schema, a regex, an EBNF
    grammar); the sequence ends when the grammar allows nothing more.
    """

    input_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    end_ids: list[int] | None = None
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    bad_token_sequences: list[list[int]] = field(default_factory=list)
    return_log_probs: bool = False
    ignore_eos: bool = False
    priority: int = 0
    arrival_time_ns: int | None = None
    timeout_ms: int | None = None
    timeout_field: str = "timeout_ms"  # the input that set the deadline, for its error
    guided_decoding: GuidedDecodingParams | None = None
    top_log_probs: int = 0
    # LoRA, with NVIDIA's semantics: `lora_task_id` names an adapter (built in, or loaded by an
    # earlier request); `lora_weights` [N, D*Hi + Ho*D] with `lora_config` [N, 3] load one under
    # that id (see lora/nvidia.py). None: the base model.
    lora_task_id: int | None = None
    lora_weights: Any = None
    lora_config: Any = None


@dataclass
class Response:
    """A step's worth of output for one request.

    Streaming: each response holds the tokens generated since the previous one. Non-streaming:
    one final response holds all generated tokens. Exactly one response per request has
    `is_final`; an error or a cancellation is reported as that final response.
    """

    request_id: int
    output_token_ids: list[int]
    is_final: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, including this response's tokens
    # Per-request performance counters (NVIDIA's return_perf_metrics outputs), so far:
    num_reused_blocks: int = 0          # KV blocks taken from the prefix cache
    num_new_blocks: int = 0             # KV blocks allocated afresh
    num_draft_tokens: int = 0           # speculative draft tokens verified
    num_accepted_draft_tokens: int = 0  # of which the target accepted
    queue_time_ns: int | None = None    # arrival -> first scheduled (final response; None: never)
    # Per output token, when the request asked for top_log_probs: the most likely token ids and
    # their log probs, most likely first.
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)

    @property
    def has_error(self) -> bool:
        return self.error is not None

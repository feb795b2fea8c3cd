"""What goes into the executor (`Request`) and what comes out (`Response`).

The verbs and shapes mirror TensorRT-LLM's executor so that the `tensorrt_llm` Triton model can
drive either engine: a request is enqueued, responses are awaited, the last one has `is_final`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from triton_backend.engine.sampling_params import SamplingParams


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

    @property
    def has_error(self) -> bool:
        return self.error is not None

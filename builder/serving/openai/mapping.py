"""OpenAI parameters -> the ensemble's inputs, and the ensemble's finish reasons -> OpenAI's.

| OpenAI | ensemble input |
| --- | --- |
| prompt / rendered messages | `text_input` |
| `max_tokens` / `max_completion_tokens` | `max_tokens` |
| `temperature`, `top_p`, `seed`, `presence_penalty`, `frequency_penalty` | same names |
| `stop` (string or list) | `stop_words` (matched on tokens, trimmed from the text) |
| `logprobs` | `return_log_probs` (+ `output_ids` for the tokens) |
| `top_k`, `min_tokens`, `repetition_penalty` (vLLM extensions) | same names |
| `ignore_eos` (vLLM extension) | `end_id` -1 (no end id, as TensorRT-LLM's benchmarks send) |
| `response_format`, `guided_*`, `structured_outputs` | `guided_decoding_guide_type`, `guided_decoding_guide` (`structured.py`) |
| `model` naming a LoRA adapter (as vLLM) | `lora_task_id` of that adapter |

`exclude_input_in_output` is always sent true: the repository may default it to false, but an
OpenAI answer never repeats the prompt.
"""
from __future__ import annotations

from builder.serving.openai.errors import internal
from builder.serving.openai.protocol import SamplingRequest
from builder.serving.openai.structured import Guide

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
FINISH_REASONS = {"end_id": "stop", "stop_words": "stop", "length": "length"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens")


def ensemble_values(request: SamplingRequest, prompt: str, max_tokens: int,
                    log_probs: bool, guide: Guide | None = None,
                    lora_task_id: int | None = None) -> dict[str, object]:
    """The ensemble inputs of one OpenAI request, by name (None: left out)."""
    values: dict[str, object] = {
        "text_input": prompt, "max_tokens": max_tokens, "stream": request.stream,
        "stop_words": request.stop_strings() or None, "exclude_input_in_output": True,
        "return_log_probs": True if log_probs else None, "lora_task_id": lora_task_id,
        "end_id": -1 if request.ignore_eos else None,
    }
    for name in SAMPLING_FIELDS:
        values[name] = getattr(request, name)
    if guide is not None:
        values["guided_decoding_guide_type"] = guide.guide_type
        values["guided_decoding_guide"] = guide.guide
    return values


def finish_reason(triton_reason: str) -> str:
    """`end_id` and `stop_words` are both OpenAI's `stop`; a cancellation we did not ask for is
    a server-side failure, never a silent short answer."""
    reason = FINISH_REASONS.get(triton_reason)
    if reason is None:
        raise internal(f"generation ended with finish reason {triton_reason!r}")
    return reason

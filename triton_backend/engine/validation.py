"""Request checks every executor shares: errors name the field and the limit."""
from __future__ import annotations

from triton_backend.engine.config import Limits
from triton_backend.engine.numbers import is_int
from triton_backend.engine.request import (MAX_TIMEOUT_MS, MAX_TOP_LOG_PROBS, PRIORITY_MAX,
                                           PRIORITY_MIN, Request)

# Stop and bad words are matched against every sequence at every step, in Python: their number
# and total length are bounded so one request cannot slow every stream of the server.
MAX_WORDS = 256          # entries in one request's stop_words (or bad_words)
MAX_WORDS_TOKENS = 1024  # tokens over all entries of one list


def check_max_tokens(max_tokens: int | None, num_input: int, limits: Limits,
                     field: str = "max_tokens") -> int:
    """The output-length rule, its one home: an integer >= 1 that fits in max_seq_len with the
    prompt's `num_input` tokens. Every hop a request crosses (the OpenAI endpoint, preprocessing,
    the BLS, the tensorrt_llm model, an executor) checks it here once, naming `field`."""
    if max_tokens is None:
        raise ValueError(f"{field} is required")
    if not is_int(max_tokens):
        raise ValueError(f"{field} must be an integer, got {max_tokens!r}")
    if max_tokens < 1:
        raise ValueError(f"{field} must be >= 1, got {max_tokens}")
    if num_input + max_tokens > limits.max_seq_len:
        raise ValueError(f"{field} {max_tokens} + {num_input} prompt tokens exceeds the engine's "
                         f"max_seq_len {limits.max_seq_len} (at most "
                         f"{limits.max_seq_len - num_input} for this prompt)")
    return max_tokens


def validate_request(request: Request, limits: Limits, vocab_size: int) -> None:
    """Raise ValueError naming the field and the limit when `request` cannot be served."""
    prompt = request.input_token_ids
    if not prompt:
        raise ValueError("input_token_ids: the prompt is empty; at least 1 token is required")
    if len(prompt) > limits.max_input_len:
        raise ValueError(f"input_token_ids: the prompt has {len(prompt)} tokens, more than "
                         f"max_input_len={limits.max_input_len}")
    if any(not is_int(t) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"input_token_ids: token ids must be integers in [0, {vocab_size})")
    check_max_tokens(request.max_tokens, len(prompt), limits)
    if request.sampling.min_tokens > request.max_tokens:
        raise ValueError(f"min_tokens ({request.sampling.min_tokens}) must be <= max_tokens "
                         f"({request.max_tokens})")
    for end_id in request.end_ids or ():
        if not is_int(end_id) or not 0 <= end_id < vocab_size:
            raise ValueError(f"end_id must be a token id in [0, {vocab_size}), got {end_id!r}")
    _check_scheduling(request)
    top = request.top_log_probs
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOG_PROBS:
        raise ValueError(f"top_log_probs must be an integer in [0, {MAX_TOP_LOG_PROBS}], "
                         f"got {top!r}")
    _check_lora_fields(request)
    for name, words in (("stop_words", request.stop_token_sequences),
                        ("bad_words", request.bad_token_sequences)):
        check_word_limits(name, words)
        if any(not w or any(not 0 <= t < vocab_size for t in w) for w in words):
            raise ValueError(f"{name}: each entry must be a non-empty list of ids in "
                             f"[0, {vocab_size})")


def _check_scheduling(request: Request) -> None:
    if not is_int(request.priority) or not PRIORITY_MIN <= request.priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                         f"got {request.priority!r}")
    timeout = request.timeout_ms
    if timeout is not None and (not is_int(timeout) or not 1 <= timeout <= MAX_TIMEOUT_MS):
        raise ValueError(f"{request.timeout_field} must be an integer in [1, {MAX_TIMEOUT_MS}] "
                         f"ms, got {timeout!r}")


def _check_lora_fields(request: Request) -> None:
    """The LoRA inputs' types; whether the engine knows the adapter is the engine's check."""
    task_id = request.lora_task_id
    if task_id is None:
        if request.lora_weights is not None or request.lora_config is not None:
            raise ValueError("lora_weights/lora_config need a lora_task_id to cache them under")
        return
    if not is_int(task_id) or not 0 <= task_id < 2**64:
        raise ValueError(f"lora_task_id must be an integer in [0, 2^64), got {task_id!r}")
    if (request.lora_weights is None) != (request.lora_config is None):
        missing = "lora_config" if request.lora_config is None else "lora_weights"
        raise ValueError(f"lora_task_id {task_id}: lora_weights and lora_config come together "
                         f"({missing} is missing)")


def check_word_limits(name: str, words: list[list[int]]) -> None:
    """At most MAX_WORDS entries and MAX_WORDS_TOKENS tokens in one stop or bad word list."""
    if len(words) > MAX_WORDS:
        raise ValueError(f"{name} has {len(words)} entries, over the limit of {MAX_WORDS}")
    num_tokens = sum(len(w) for w in words)
    if num_tokens > MAX_WORDS_TOKENS:
        raise ValueError(f"{name} has {num_tokens} tokens in all, over the limit of "
                         f"{MAX_WORDS_TOKENS}")


def check_kv_capacity(request: Request, num_blocks: int, tokens_per_block: int) -> None:
    """Raise ValueError when `request` alone needs more KV blocks than the whole cache holds."""
    needed = -(-(len(request.input_token_ids) + request.max_tokens) // tokens_per_block)
    if needed > num_blocks:
        raise ValueError(f"max_tokens: the request needs {needed} KV blocks but the cache holds "
                         f"{num_blocks} (kv_cache budget too small)")

"""Request checks every executor shares: errors name the field and the limit."""
from __future__ import annotations

from triton_backend.engine.config import Limits
from triton_backend.engine.request import Request


def validate_request(request: Request, limits: Limits, vocab_size: int) -> None:
    """Raise ValueError naming the field and the limit when `request` cannot be served."""
    prompt = request.input_token_ids
    if not prompt:
        raise ValueError("input_token_ids: the prompt is empty; at least 1 token is required")
    if len(prompt) > limits.max_input_len:
        raise ValueError(f"input_token_ids: the prompt has {len(prompt)} tokens, more than "
                         f"max_input_len={limits.max_input_len}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"input_token_ids: token ids must be integers in [0, {vocab_size})")
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) \
            or request.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
    if len(prompt) + request.max_tokens > limits.max_seq_len:
        raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens "
                         f"({request.max_tokens}) exceeds max_seq_len={limits.max_seq_len}; "
                         f"max_tokens may be at most {limits.max_seq_len - len(prompt)}")
    for name, words in (("stop_words", request.stop_token_sequences),
                        ("bad_words", request.bad_token_sequences)):
        if any(not w or any(not 0 <= t < vocab_size for t in w) for w in words):
            raise ValueError(f"{name}: each entry must be a non-empty list of ids in "
                             f"[0, {vocab_size})")


def check_kv_capacity(request: Request, num_blocks: int, tokens_per_block: int) -> None:
    """Raise ValueError when `request` alone needs more KV blocks than the whole cache holds."""
    needed = -(-(len(request.input_token_ids) + request.max_tokens) // tokens_per_block)
    if needed > num_blocks:
        raise ValueError(f"max_tokens: the request needs {needed} KV blocks but the cache holds "
                         f"{num_blocks} (kv_cache budget too small)")

"""OpenAI response objects as plain dicts: completions, chat completions, their stream chunks,
`usage` and `logprobs`.

Log probabilities: the engine returns the log probability of each token it generated (not the
alternatives), so `logprobs` carries the sampled tokens only; `top_logprobs` above 0 is refused
at the request (see `service`). With a stop string, the stop tokens are generated, so they have
entries although the text is trimmed before them.
"""
from __future__ import annotations

from typing import Callable, Sequence

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(token_ids: Sequence[int], log_probs: Sequence[float],
                  token_text: TokenText) -> dict:
    content = []
    for token_id, log_prob in zip(token_ids, log_probs):
        text = token_text(token_id)
        content.append({"token": text, "logprob": float(log_prob),
                        "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], log_probs: Sequence[float],
                        token_text: TokenText, text_offset: int) -> dict:
    """The legacy completions form; `text_offset` is where the first token starts."""
    tokens, offsets = [], []
    for token_id in token_ids:
        tokens.append(token_text(token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [float(v) for v in log_probs][:len(tokens)],
            "top_logprobs": None, "text_offset": offsets}


class ResponseBuilder:
    """The envelope shared by every object of one response: id, creation time, model name."""

    def __init__(self, kind: str, response_id: str, created: int, model: str) -> None:
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be chat or completion, got {kind!r}")
        self.kind, self.id, self.created, self.model = kind, response_id, created, model

    def _envelope(self, stream: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def full(self, text: str, finish_reason: str, counts: dict,
             logprobs: dict | None) -> dict:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": counts}

    def chunk(self, text: str | None, finish_reason: str | None, logprobs: dict | None,
              with_usage_field: bool, role: str | None = None) -> dict:
        """One stream chunk; `with_usage_field` adds `usage: null` (include_usage is on)."""
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": role, **delta}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
        body = {**self._envelope(True), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": counts}

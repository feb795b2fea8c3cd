"""OpenAI response objects as plain dicts: completions, chat completions, their stream chunks,
`usage` and `logprobs`.

Log probabilities: the log probability of each generated token and, when asked for
(`top_logprobs` on chat, `logprobs: N` on completions, up to 20), the N most likely tokens at
each position with theirs, from the model's raw distribution (before penalties, temperature and
guided decoding's masks, as vLLM reports them by default); then the token's own log prob is the
raw one too. With a stop string, the stop tokens are generated, so they have entries although
the text is trimmed before them.
"""
from __future__ import annotations

from typing import Callable, Sequence

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _entry(token_id: int, log_prob: float, token_text: TokenText) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": float(log_prob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], log_probs: Sequence[float],
                  token_text: TokenText, top: Sequence | None = None) -> dict:
    """`top`: per token, [(token id, log prob), ...] most likely first (empty: none asked)."""
    content = []
    for i, (token_id, log_prob) in enumerate(zip(token_ids, log_probs)):
        alternatives = top[i] if top and i < len(top) else []
        content.append({**_entry(token_id, log_prob, token_text), "top_logprobs": [
            _entry(t, lp, token_text) for t, lp in alternatives]})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], log_probs: Sequence[float],
                        token_text: TokenText, text_offset: int,
                        top: Sequence | None = None) -> dict:
    """The legacy completions form; `text_offset` is where the first token starts. Its
    `top_logprobs` maps each alternative's text to its log prob (tokens with the same text
    keep the likeliest)."""
    tokens, offsets = [], []
    for token_id in token_ids:
        tokens.append(token_text(token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    alternatives = None
    if top:
        alternatives = []
        for row in top[:len(tokens)]:
            texts: dict[str, float] = {}
            for t, lp in row:
                texts.setdefault(token_text(t), float(lp))
            alternatives.append(texts)
    return {"tokens": tokens, "token_logprobs": [float(v) for v in log_probs][:len(tokens)],
            "top_logprobs": alternatives, "text_offset": offsets}


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

    def choice(self, index: int, text: str | None, finish_reason: str, logprobs: dict | None,
               tool_calls: list[dict] | None = None) -> dict:
        """One choice of the non-streamed response (`tool_calls`: the message's calls; `text`
        None: no content, as OpenAI's messages with calls)."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def full(self, choices: list[dict], counts: dict) -> dict:
        """The non-streamed response."""
        return {**self._envelope(False), "choices": choices, "usage": counts}

    def chunk(self, text: str | None, finish_reason: str | None, logprobs: dict | None,
              with_usage_field: bool, role: str | None = None, index: int = 0,
              tool_calls: list[dict] | None = None) -> dict:
        """One stream chunk of choice `index`; `with_usage_field` adds `usage: null`
        (include_usage is on); `tool_calls`: the delta's calls (each with its `index`)."""
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": role, **delta}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
        body = {**self._envelope(True), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": counts}

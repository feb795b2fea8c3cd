"""What one request did, timed on the client's monotonic clock.

Definitions (the ones genai-perf and vLLM's benchmark_serving use):
- TTFT: from sending the request to the first response that carries text.
- ITL: per request, the mean time between output tokens after the first one,
  (last text response - first text response) / (output tokens - 1); streamed requests only.
- E2E: from sending the request to its final response.
Output tokens: the server's own count when it returns `num_output_tokens` (llm-forge reports the
running total of generated tokens, so the largest value seen is the request's count); else the
output text re-tokenized with the engine's tokenizer (as genai-perf does; it over-counts text
that does not re-tokenize the way it was generated); else one per text response.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request. `start` is seconds from its level's start; the other times from its own send."""

    index: int
    max_tokens: int
    stream: bool
    num_input_tokens: int | None = None
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each response with text
    end: float | None = None  # arrival of the final response
    text: str = ""
    server_output_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    error: str | None = None
    cancelled: bool = False

    def add_chunk(self, elapsed: float, text: str) -> None:
        if text:
            self.chunk_times.append(elapsed)
            self.text += text

    def note_server_tokens(self, value: int | None) -> None:
        # Our engine reports a running total; keep the largest seen.
        if value is not None:
            self.server_output_tokens = max(value, self.server_output_tokens or 0)

    def count_output_tokens(self, tokenizer: Any | None) -> None:
        """Set `output_tokens` from the server's count, the text (tokenizer), or the chunks."""
        if self.server_output_tokens is not None:
            self.output_tokens = self.server_output_tokens
            self.output_tokens_source = "server"
        elif tokenizer is not None:
            self.output_tokens = len(tokenizer.encode(self.text, add_special_tokens=False))
            self.output_tokens_source = "tokenizer"
        else:
            self.output_tokens = len(self.chunk_times)
            self.output_tokens_source = "chunks"

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.ok and self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end if self.ok else None

    @property
    def itl(self) -> float | None:
        if not (self.ok and self.stream and self.output_tokens > 1 and len(self.chunk_times) > 1):
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def to_dict(self, keep_text: bool = False) -> dict[str, Any]:
        out = {"index": self.index, "start_s": self.start, "ttft_s": self.ttft,
               "itl_s": self.itl, "e2e_s": self.e2e, "num_input_tokens": self.num_input_tokens,
               "max_tokens": self.max_tokens, "output_tokens": self.output_tokens,
               "output_tokens_source": self.output_tokens_source,
               "server_output_tokens": self.server_output_tokens, "stream": self.stream,
               "chunk_times_s": [round(t, 6) for t in self.chunk_times],
               "error": self.error, "cancelled": self.cancelled}
        if keep_text:
            out["text"] = self.text
        return out

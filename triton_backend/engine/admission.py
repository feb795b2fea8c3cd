"""Admission control: a bound on what waits, so an overloaded server refuses at once instead of
queueing without end (clients retry a "server busy" refusal; nothing accepted is dropped).

"Waiting" is what the executor accepted and the scheduler has not running: requests queued for
the engine loop plus the scheduler's waiting queue (preempted sequences included, counted with
every token they will prefill again). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from triton_backend.engine.numbers import is_int


class ServerBusy(RuntimeError):
    """A request refused because too much is waiting; the message starts with "server busy"."""


@dataclass(frozen=True)
class AdmissionLimits:
    """0 means unbounded."""

    max_waiting_requests: int = 0
    max_waiting_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_prompt_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: unbounded), got {value!r}")

    def check(self, num_waiting: int, num_waiting_tokens: int, num_prompt_tokens: int) -> None:
        """Raise ServerBusy when one more request of `num_prompt_tokens` would go over a bound.
        When nothing waits, any request is admitted (a long prompt is never refused for good)."""
        limit = self.max_waiting_requests
        if limit and num_waiting >= limit:
            raise ServerBusy(f"server busy: {num_waiting} requests waiting (limit {limit})")
        limit = self.max_waiting_prompt_tokens
        if limit and num_waiting_tokens and num_waiting_tokens + num_prompt_tokens > limit:
            raise ServerBusy(f"server busy: {num_waiting_tokens} prompt tokens waiting "
                             f"(limit {limit}), this prompt adds {num_prompt_tokens}")

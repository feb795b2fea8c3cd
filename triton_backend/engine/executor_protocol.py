"""`ExecutorVerbs`: the verbs every executor offers, as TensorRT-LLM's executor names them.

`Executor` (the loop in this process), `ProcessExecutor` (the loop in an engine process) and
`NaiveExecutor` (the reference baseline) are interchangeable behind the `tensorrt_llm` model and
the benchmarks; this protocol is that contract, and a test holds each class to its signatures.
"""
from __future__ import annotations

from typing import Protocol

from triton_backend.engine.request import Request, Response


class ExecutorVerbs(Protocol):
    def enqueue_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and queue `request`; returns its id (the caller's `request_id`, if given,
        must not be in use). Raises ValueError naming the bad field."""

    def cancel_request(self, request_id: int) -> None:
        """End the request early; its final response says `cancelled`."""

    def await_responses(self, request_id: int | None = None, timeout: float | None = None
                        ) -> list[Response]:
        """The responses ready (of one request, or of all), waiting up to `timeout`."""

    def is_alive(self) -> bool:
        """False once the executor is shut down or its engine is down for good."""

    def get_stats(self) -> dict:
        """The counters published on /metrics."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, end what runs, stop the loop."""

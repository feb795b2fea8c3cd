"""Responses waiting to be collected, by request id: the mailbox behind `await_responses`."""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterable

from triton_backend.engine.request import Response


class ResponseQueue:
    """Thread-safe. Producers `put`; consumers `take` what is ready for one request or for all."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._responses: dict[int, collections.deque[Response]] = collections.defaultdict(
            collections.deque)

    def put(self, responses: Iterable[Response]) -> None:
        with self._ready:
            added = False
            for response in responses:
                self._responses[response.request_id].append(response)
                added = True
            if added:
                self._ready.notify_all()

    def take(self, request_id: int | None, timeout: float | None,
             producer_alive: Callable[[], bool]) -> list[Response]:
        """Wait up to `timeout` seconds (forever when None) for at least one response of
        `request_id` (any request when None); return [] on timeout or once the producer is gone
        and nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while not self._has(request_id):
                remaining = None if deadline is None else deadline - time.monotonic()
                if (remaining is not None and remaining <= 0) or not producer_alive():
                    return []
                # Bounded waits, so a producer that dies without a last put is noticed.
                self._ready.wait(min(remaining, 1.0) if remaining is not None else 1.0)
            ids = list(self._responses) if request_id is None else [request_id]
            taken: list[Response] = []
            for rid in ids:
                taken.extend(self._responses.pop(rid, ()))
            return taken

    def _has(self, request_id: int | None) -> bool:
        if request_id is None:
            return any(self._responses.values())
        return bool(self._responses.get(request_id))


class LoopMailbox:
    """Two verbs of an executor whose loop thread fills `self._mailbox` (a `ResponseQueue`) and
    sets `self._loop_alive` False when it ends (the in-process and the naive executors)."""

    _mailbox: ResponseQueue
    _loop_alive: bool

    def await_responses(self, request_id: int | None = None, timeout: float | None = None
                        ) -> list[Response]:
        """Responses ready for `request_id` (or for every request when None); waits up to
        `timeout` seconds for at least one (forever when None). May return an empty list."""
        return self._mailbox.take(request_id, timeout, lambda: self._loop_alive)

    def is_alive(self) -> bool:
        """True until the loop has ended (shut down or failed)."""
        return self._loop_alive

"""`Progress`: a count the engine loop's thread advances while it works, for a watchdog to read.

The engine process reports the count to its client in every heartbeat, and the client's watchdog
(`process/watchdog.py`) kills an engine whose count stands still for `freeze_seconds`: a loop
that is deadlocked, sleeps or spins forever inside a step. So every legitimate long operation
advances it at least every fraction of a second: the loop on every iteration (an idle loop wakes
itself every `LOOP_TICK_SECONDS`), the model after every decoder layer (a full `max_num_tokens`
prefill included), the adapter cache per projection it converts. Kernel compilation and the GEMM
plans are measured while the engine loads, before it reports ready, so no step waits for them.

One writer (the loop's thread) and readers on other threads: a plain int, no lock; a reader sees
a value at most one tick old. Pure Python.
"""
from __future__ import annotations

# How long an idle loop waits for work before it advances the count anyway.
LOOP_TICK_SECONDS = 0.25


class Progress:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def tick(self) -> None:
        self.count += 1

"""Sequences, a fake model runner and an injected clock for the scheduler, block-manager and
admission tests (pure Python: no torch, no model). Import it as `scheduling`."""
from __future__ import annotations

from triton_backend.engine import Request
from triton_backend.engine.scheduler import Scheduler, SchedulerOutput
from triton_backend.engine.sequence import Sequence

SAMPLED = 7  # the token the fake runner samples for every sequence


class Clock:
    """An injected clock (ns) that moves only when a test sets `now`."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def seq(seq_id: int, prompt: int | list[int] = 2, max_tokens: int = 8, priority: int = 0
        ) -> Sequence:
    """A sequence with prompt ids 1..`prompt` (a length) or the given ids, no end ids."""
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Sequence.from_request(seq_id, Request(ids, max_tokens, priority=priority), frozenset())


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with the fake runner; returns the scheduler output."""
    out = scheduler.schedule()
    scheduler.update(out, {c.seq_id: (SAMPLED, 0.0) for c in out.chunks if c.needs_sample})
    return out


def run(scheduler: Scheduler, steps: int, computed: bool = False) -> list[list[tuple[int, ...]]]:
    """`steps` steps; per step, each chunk as (seq_id, new tokens), or with `computed`
    (seq_id, tokens computed before it, new tokens)."""
    log = []
    for _ in range(steps):
        chunks = step(scheduler).chunks
        log.append([(c.seq_id, c.num_computed_tokens, len(c.new_token_ids)) if computed
                    else (c.seq_id, len(c.new_token_ids)) for c in chunks])
    return log

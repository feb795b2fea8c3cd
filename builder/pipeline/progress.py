"""Progress of a long build loop with its elapsed time and an estimate of what is left.

Calibration (minutes for AWQ) and the quality gate (minutes on two cores) run loops of similar
units: batches, windows, questions. A count alone does not tell a user whether to wait or to
come back later, so each unit's line carries the time so far and the time left.

Units may cost differently (AWQ's search pass costs several of its statistics pass): each unit
has a relative cost, consecutive units of one cost form a phase, and the time left is the current
phase's own measured pace (seconds per unit of cost) times the cost still to come. A later,
dearer phase is thus estimated from the stated ratio only until its first unit is timed.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence


def format_duration(seconds: float) -> str:
    """45s, 3m05s, 1h02m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Eta:
    """`tick()` once per unit done: says "LABEL i/N (elapsed, about T left)".

    `costs` gives each unit's relative cost (default: all 1); `clock` is injectable so tests
    need not wait."""

    def __init__(self, label: str, total: int, say: Callable[[str], None],
                 costs: Sequence[float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total < 1:
            raise ValueError(f"progress of {label!r}: total must be >= 1, got {total}")
        if costs is not None and (len(costs) != total or min(costs) <= 0):
            raise ValueError(f"progress of {label!r}: {total} positive costs expected")
        self.label, self.total, self.say, self.clock = label, total, say, clock
        self.costs = list(costs) if costs is not None else [1.0] * total
        self.done = 0
        self.start = clock()
        self.phase_start, self.phase_cost = self.start, 0.0
        self.last = self.start  # the clock at the last unit done

    def seconds_left(self, now: float) -> float:
        """The current phase's pace times the cost of the units still to come."""
        pace = (now - self.phase_start) / self.phase_cost
        return pace * sum(self.costs[self.done:])

    def tick(self, detail: str = "") -> None:
        if self.done >= self.total:  # a loop that runs longer than announced: say so, no guess
            self.say(f"{self.label} {self.done + 1} (beyond the {self.total} expected)")
            return
        now = self.clock()
        if self.done and self.costs[self.done] != self.costs[self.done - 1]:
            self.phase_start, self.phase_cost = self.last, 0.0  # a new phase: its own pace
        self.phase_cost += self.costs[self.done]
        self.done += 1
        self.last = now
        elapsed = now - self.start
        timing = (format_duration(elapsed) if self.done == self.total else
                  f"{format_duration(elapsed)} elapsed, about "
                  f"{format_duration(self.seconds_left(now))} left")
        suffix = f": {detail}" if detail else ""
        self.say(f"{self.label} {self.done}/{self.total} ({timing}){suffix}")

"""Is the engine process making progress? The client's side of the engine's heartbeats.

Every message of the engine process carries its loop's progress count (`engine/progress.py`), and
a live engine sends one at least every `main.HEARTBEAT_SECONDS`. `ProgressWatch` notes when the
count last moved: a process stopped by SIGSTOP sends nothing, a main thread that is deadlocked or
loops forever inside a step sends a count that stands still; either is no progress. An engine
without a count (the naive baseline) sends None: there any message counts as progress, so only a
silent process is caught.

`Watchdog` is the thread that asks, every `CHECK_SECONDS`, whether the watched engine has made
no progress for `freeze_seconds`, not counting the time it waited for a CPU, and then calls
`on_freeze(seconds)`. A machine loaded past its cores (a noisy neighbour, a CFS quota spent)
delays a step by the time its threads sit in the run queue, which Linux counts per thread
(`/proc/<pid>/task/<tid>/schedstat`): that time is no freeze. A stopped process, a deadlocked
thread or one looping in a kernel waits for no CPU, so its stall counts in full.
`ProcessExecutor` disarms the watch and kills the engine there, and its restart path ends the requests in flight and
starts a new one, re-arming the watch once that one is ready (starting an engine is no step: its
own start-up timeout bounds it). So one freeze is acted on once.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from triton_backend.engine.numbers import is_number

# Detection (no progress for this long, plus at most a heartbeat and a check) and the kill stay
# within the 10 s a frozen engine must be noticed in; the slowest legitimate progress gap (a
# decoder layer of a full prefill on a loaded machine) is well under a second.
DEFAULT_FREEZE_SECONDS = 5.0
# Several heartbeats: a message delayed on a loaded machine is no freeze.
MIN_FREEZE_SECONDS = 1.0
CHECK_SECONDS = 0.1
# A stall is measured against the run-queue time from this long into it (shorter ones are steps).
STARVATION_FROM_SECONDS = 0.5


def run_queue_seconds(pid: int) -> float | None:
    """The most time any thread of process `pid` has spent waiting for a CPU, in all (the
    second field of each thread's schedstat, in ns); None where Linux does not say."""
    longest = None
    try:
        tasks = list((Path("/proc") / str(pid) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            waited = int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        longest = waited if longest is None else max(longest, waited)
    return longest


def check_freeze_seconds(value: float | None) -> float | None:
    """`value` when it is a usable limit (None: no watchdog); ValueError naming the field."""
    if value is None:
        return None
    if not is_number(value) or not value >= MIN_FREEZE_SECONDS:
        raise ValueError(f"engine_freeze_seconds must be a number >= {MIN_FREEZE_SECONDS:g} "
                         f"(or None: no watchdog), got {value!r}")
    return float(value)


def freeze_cause(seconds: float) -> str:
    """Why a frozen engine was killed, as request errors and the probe name it."""
    return (f"the engine made no progress for {seconds:.1f} s (frozen or deadlocked) "
            f"and was killed")


class ProgressWatch:
    """Thread-safe. `observe` each message's count; `stalled_seconds` while armed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._armed = False
        self._count: int | None = None
        self._since = clock()
        self.longest_gap = 0.0  # the longest wait between two moves of the count, while armed

    def arm(self) -> None:
        """Watch a new engine, from now."""
        with self._lock:
            self._armed, self._count, self._since = True, None, self._clock()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    def observe(self, count: int | None) -> None:
        with self._lock:
            if count is None or count != self._count:
                now = self._clock()
                if self._armed:
                    self.longest_gap = max(self.longest_gap, now - self._since)
                self._count, self._since = count, now

    def seconds_since_progress(self) -> float:
        with self._lock:
            return self._clock() - self._since

    def stalled_seconds(self) -> float | None:
        """Seconds without progress, None while disarmed."""
        with self._lock:
            return self._clock() - self._since if self._armed else None


class Watchdog:
    """`starved()`: the watched engine's run-queue seconds so far (`run_queue_seconds`), None when
    unknown (then every second of a stall counts)."""

    def __init__(self, watch: ProgressWatch, freeze_seconds: float,
                 on_freeze: Callable[[float], None],
                 starved: Callable[[], float | None] = lambda: None) -> None:
        self.watch, self.freeze_seconds, self.on_freeze = watch, freeze_seconds, on_freeze
        self.starved = starved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        baseline = None  # run-queue seconds early in the current stall
        while not self._stop.wait(CHECK_SECONDS):
            stalled = self.watch.stalled_seconds()
            if stalled is None or stalled < STARVATION_FROM_SECONDS:
                baseline = None
                continue
            starved = self.starved()
            if baseline is None:
                baseline = starved
            waited = starved - baseline if starved is not None and baseline is not None else 0.0
            if stalled - waited >= self.freeze_seconds:
                self.on_freeze(stalled)  # which disarms the watch, or finds it re-armed
                baseline = None

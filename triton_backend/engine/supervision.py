"""When to restart a crashed engine, and when to stop trying (a crash loop).

The executor restarts its loop in place after a crash outside a step, and `ProcessExecutor`
starts a new engine process when its process dies (or its watchdog killed it, frozen). Either
gives up after `max_restarts` crashes within `window_seconds`: an engine that crashes again and
again is reported down (the model refuses requests and its health metric drops) instead of
failing every request forever. `EngineHealth` is what an executor reports of its engine.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

from triton_backend.engine.numbers import is_int, is_number


@dataclass(frozen=True)
class EngineHealth:
    """What an executor's engine is doing: `running`; `restarting` in place after a crash or a
    freeze (`reason`: the cause); `down`, shut down or for good (`reason`: why)."""

    state: str
    reason: str = ""


def health_of(executor) -> EngineHealth:
    """`executor.health()`, or for an executor without one (the loop in a thread of this
    process, the naive baseline) running while its loop lives, else down."""
    health = getattr(executor, "health", None)
    if health is not None:
        return health()
    if executor.is_alive():
        return EngineHealth("running")
    return EngineHealth("down", getattr(executor, "down_reason", "") or "stopped")


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    window_seconds: float = 300.0

    def __post_init__(self) -> None:
        if not is_int(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"engine_max_restarts must be an integer >= 0, "
                             f"got {self.max_restarts!r}")
        if not is_number(self.window_seconds) or not self.window_seconds > 0:
            raise ValueError(f"engine_restart_window_s must be a number > 0, "
                             f"got {self.window_seconds!r}")


class CrashLoop:
    """Counts crashes; `allow_restart()` after each says whether another restart is allowed."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._recent: collections.deque[float] = collections.deque()
        self.num_crashes = 0

    def allow_restart(self) -> bool:
        now = self._clock()
        self.num_crashes += 1
        self._recent.append(now)
        while self._recent and now - self._recent[0] > self.policy.window_seconds:
            self._recent.popleft()
        return len(self._recent) <= self.policy.max_restarts

    @property
    def num_recent(self) -> int:
        """Crashes within the window, as of the last `allow_restart()`."""
        return len(self._recent)

    def describe(self) -> str:
        return (f"{len(self._recent)} crashes within {self.policy.window_seconds:g} s "
                f"(engine_max_restarts {self.policy.max_restarts})")

"""Fault injection for testing the failure paths on a real server; off unless asked for.

With `LLM_FORGE_FAULT_FILE=PATH` in the environment (the engine process inherits it from the
server), the engine looks for that file before each step. When it exists, the first engine to
see it removes it and injects the fault the file names:

- `step` (the default, or `step:MESSAGE`): a RuntimeError inside the next step, so that step's
  batch fails and the loop goes on;
- `oom`: a MemoryError inside the next step (what a failed allocation raises);
- `loop`: an exception outside any step, so the loop itself restarts in place;
- `exit` (or `exit:CODE`): the process exits at once, as if killed (no goodbye to the client);
- `hang` (or `hang:SECONDS`): the next step never ends (or only after SECONDS) and advances no
  progress: a deadlocked or endlessly looping loop thread, while the process's other threads
  live on (the watchdog's case besides SIGSTOP);
- `slow:SECONDS`: the next step takes SECONDS but advances the progress count all along, as a
  long legitimate step does (the watchdog must leave it alone).

Without the variable `check()` is one attribute test per step. Write the file with `inject`: it
appears whole (an engine polling the path never reads it half-written, as an empty `step`).
"""
from __future__ import annotations

import os
import time

from triton_backend.engine.progress import Progress

FAULT_FILE_ENV = "LLM_FORGE_FAULT_FILE"
STEP_FAULTS = ("step", "oom", "exit", "hang", "slow")
LOOP_FAULTS = ("loop",)
SLOW_TICK_SECONDS = 0.05  # how often a `slow` step advances the progress count


def inject(path, fault: str) -> None:
    """Ask for `fault` (e.g. "oom:message") at `path`, atomically."""
    staged = f"{path}.staged"
    with open(staged, "w") as handle:
        handle.write(fault)
    os.replace(staged, path)


class InjectedFault(RuntimeError):
    """Raised where a test asked for a failure."""


class FaultInjector:
    """`progress`: the engine's progress count, which a `slow` step advances."""

    def __init__(self, path: str | None, progress: Progress | None = None) -> None:
        self.path = path or None
        self.progress = progress or Progress()

    @classmethod
    def from_env(cls, progress: Progress | None = None) -> "FaultInjector":
        return cls(os.environ.get(FAULT_FILE_ENV), progress)

    def check(self, where: str) -> None:
        """Inject the pending fault if it belongs to `where` ("step" or "loop")."""
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path) as handle:
                text = handle.read().strip() or "step"
        except OSError:
            return
        kind, _, detail = text.partition(":")
        if kind not in (STEP_FAULTS if where == "step" else LOOP_FAULTS):
            return
        try:
            os.remove(self.path)  # only one engine takes a fault
        except FileNotFoundError:
            return
        if kind == "exit":
            os._exit(int(detail or 137))
        if kind in ("hang", "slow"):
            return self._stall(float(detail) if detail else None, kind == "slow")
        if kind == "oom":
            raise MemoryError(detail or "injected: out of memory")
        raise InjectedFault(detail or f"injected {kind} fault")

    def _stall(self, seconds: float | None, progressing: bool) -> None:
        """Hold the calling thread `seconds` (forever when None), ticking progress if asked."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(SLOW_TICK_SECONDS)
            if progressing:
                self.progress.tick()

"""Fault injection for testing the failure paths on a real server; off unless asked for.

With `LLM_FORGE_FAULT_FILE=PATH` in the environment (the engine process inherits it from the
server), the engine looks for that file before each step. When it exists, the first engine to
see it removes it and injects the fault the file names:

- `step` (the default, or `step:MESSAGE`): a RuntimeError inside the next step, so that step's
  batch fails and the loop goes on;
- `oom`: a MemoryError inside the next step (what a failed allocation raises);
- `loop`: an exception outside any step, so the loop itself restarts in place;
- `exit` (or `exit:CODE`): the process exits at once, as if killed (no goodbye to the client).

Without the variable `check()` is one attribute test per step. Write the file with `inject`: it
appears whole (an engine polling the path never reads it half-written, as an empty `step`).
"""
from __future__ import annotations

import os

FAULT_FILE_ENV = "LLM_FORGE_FAULT_FILE"
STEP_FAULTS = ("step", "oom", "exit")
LOOP_FAULTS = ("loop",)


def inject(path, fault: str) -> None:
    """Ask for `fault` (e.g. "oom:message") at `path`, atomically."""
    staged = f"{path}.staged"
    with open(staged, "w") as handle:
        handle.write(fault)
    os.replace(staged, path)


class InjectedFault(RuntimeError):
    """Raised where a test asked for a failure."""


class FaultInjector:
    def __init__(self, path: str | None) -> None:
        self.path = path or None

    @classmethod
    def from_env(cls) -> "FaultInjector":
        return cls(os.environ.get(FAULT_FILE_ENV))

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
        if kind == "oom":
            raise MemoryError(detail or "injected: out of memory")
        raise InjectedFault(detail or f"injected {kind} fault")

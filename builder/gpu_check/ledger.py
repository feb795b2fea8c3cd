"""The order of `forge gpu-check`'s checks, each in its own time budget, and what each one cost.

A GPU is lent for minutes, cold: whatever a check finds must survive the next one failing. So
each check runs alone (`Ledger.run`): it is timed, its counts of the costly things (Triton
compiles, graph captures, engine builds and loads, reference runs) are kept beside its time, an
exception or an exhausted budget ends that check only (its status says which, and the checks
that need its result say they were skipped), and the report is written to disk after every
check, so a run killed from outside still leaves the last complete one.

The run as a whole has a budget too (`total_s`): a check gets at most what is left of it, and
once it is spent the remaining checks are recorded as not run. A budget is enforced with SIGALRM
in the main thread: the check is interrupted where Python next
runs (a GPU kernel or a subprocess already running finishes or is killed by the caller, which
sizes its own waits with `remaining()`). `LLM_FORGE_GPU_CHECK_FAIL` names checks (comma
separated) that raise at their start: how the tests prove the report survives any one failure.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

FAIL_ENV = "LLM_FORGE_GPU_CHECK_FAIL"
COUNTED = ("triton_compiles", "kernel_variants", "graph_captures", "engine_builds",
           "engine_loads", "reference_runs")


class CheckTimeout(Exception):
    """A check ran out of its budget."""


class InjectedFailure(RuntimeError):
    """The failure `LLM_FORGE_GPU_CHECK_FAIL` asked for."""


class Skipped(Exception):
    """A check whose input an earlier check did not produce."""


# Counted where the work happens (models.py, parity.py, speed.py) and read per check by the
# ledger: process-wide, as the things counted (Triton's compile cache, the GPU) are.
COUNTS: Counter[str] = Counter()


def count(what: str, n: int = 1) -> None:
    if what not in COUNTED:
        raise ValueError(f"count: {what!r} is not one of {', '.join(COUNTED)}")
    COUNTS[what] += n


def _kernel_counts() -> dict[str, int]:
    """Distinct Triton kernel variants launched in this process and, where Triton compiles (a
    GPU), its compiles: each variant compiles once per process, cold."""
    from triton_backend.engine.gpu.variants import VARIANTS

    return {"kernel_variants": VARIANTS.num_variants, "triton_compiles": VARIANTS.num_compiles}


@dataclass
class CheckRecord:
    name: str
    budget_s: float
    status: str = "pending"  # ok, failed, timed out, skipped (its input missing), not run
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class Ledger:
    """Runs checks in order and keeps their records; `write` is called after every check."""

    def __init__(self, write: Callable[[], None], say: Callable[[str], None],
                 budget_scale: float = 1.0, total_s: float | None = None) -> None:
        """`total_s`: the whole run's budget; each check gets at most what is left of it, and
        once it is spent the rest are skipped, saying so (the device is lent for minutes)."""
        self.write, self.say = write, say
        self.budget_scale = budget_scale
        self.total_s = total_s
        self.started = time.monotonic()
        self.records: list[CheckRecord] = []
        self.failing = {n.strip() for n in os.environ.get(FAIL_ENV, "").split(",") if n.strip()}
        self._deadline: float | None = None

    def remaining(self) -> float | None:
        """Seconds left to the running check (None outside one)."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def run(self, name: str, budget_s: float, check: Callable[[], Any]) -> Any:
        """Run `check` within `budget_s` (times the ledger's scale); its result, or None when it
        failed, ran out of time or was skipped (the record says which)."""
        record = CheckRecord(name, budget_s * self.budget_scale)
        if self.total_s is not None:
            left = self.total_s - (time.monotonic() - self.started)
            record.budget_s = min(record.budget_s, max(0.0, left))
        self.records.append(record)
        if record.budget_s <= 0:
            record.status = "not run"
            record.error = f"the run's {self.total_s:.0f} s budget is spent"
            record.counts = {k: 0 for k in COUNTED}
            self.say(f"{name}: not run - {record.error}")
            self.write()
            return None
        before = {**COUNTS, **_kernel_counts()}
        start = time.monotonic()
        result = None
        try:
            with _alarm(record.budget_s):
                self._deadline = start + record.budget_s
                if name in self.failing:
                    raise InjectedFailure(f"{FAIL_ENV} names {name!r}")
                result = check()
            record.status = "ok"
        except CheckTimeout:
            record.status = "timed out"
            record.error = f"ran out of its {record.budget_s:.0f} s budget"
        except Skipped as exc:
            record.status, record.error = "skipped", str(exc)
        except Exception as exc:  # noqa: BLE001 - one check's failure must not end the run
            record.status = "failed"
            record.error = f"{type(exc).__name__}: {exc}"[-2000:]
        finally:
            self._deadline = None
        record.seconds = time.monotonic() - start
        after = {**COUNTS, **_kernel_counts()}
        record.counts = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTED}
        self.say(f"{name}: {record.status} in {record.seconds:.1f} s"
                 f"{self._counts_line(record.counts)}"
                 f"{'' if record.error is None else ' - ' + record.error.splitlines()[-1]}")
        self.write()
        return result

    @staticmethod
    def _counts_line(counts: dict[str, int]) -> str:
        shown = [f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v]
        return f" ({', '.join(shown)})" if shown else ""

    def totals(self) -> dict[str, Any]:
        counts = {k: sum(r.counts.get(k, 0) for r in self.records) for k in COUNTED}
        return {"seconds": sum(r.seconds for r in self.records), **counts}

    def to_list(self) -> list[dict]:
        return [r.__dict__.copy() for r in self.records]


class _alarm:
    """SIGALRM after `seconds`, raising CheckTimeout in the main thread; restores what was."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def expire(signum, frame):
            raise CheckTimeout()

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, self.seconds))

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader (or a run killed mid-write) never sees half a report."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)

"""How long a step takes for how many rows: a line fitted online, to size prefill chunks.

A step's time is modelled as `fixed + per_row * rows`, fitted by exponentially weighted least
squares over recent steps (old steps fade, so the fit follows the machine's load). On a GPU, or
a CPU reading weights from memory, most of a decode step is the fixed part and a prefill chunk
rides along almost free; on a compute-bound CPU every row costs about the same. The scheduler
asks `extra_rows`: how many prefill rows a step may carry beside its decoding rows and stay
within `factor` times a decode-only step.
"""
from __future__ import annotations


class StepCostModel:
    def __init__(self, decay: float = 0.98, min_steps: int = 8) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not seconds > 0:
            return
        d = self.decay
        self.num_steps += 1
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + rows
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + rows * rows
        self._sxy = self._sxy * d + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None before `min_steps` steps.

        When the steps seen had (almost) one row count, or the fit is not a rising line, the
        split is unknown and the whole time is taken as per-row cost: the cautious reading.
        """
        if self.num_steps < self.min_steps:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        variance = self._sxx / self._n - mean_x * mean_x
        proportional = (0.0, mean_y / mean_x)
        if variance < 0.25:
            return proportional
        per_row = (self._sxy / self._n - mean_x * mean_y) / variance
        fixed = mean_y - per_row * mean_x
        if per_row <= 0 or fixed < 0:
            return proportional
        return fixed, per_row

    def extra_rows(self, rows: int, factor: float) -> int:
        """Rows a step of `rows` decoding rows may add and stay within `factor` times its time
        (at least 1, so a prefill always moves on)."""
        fixed, per_row = self.fit() or (0.0, 1.0)
        return max(1, int((factor - 1.0) * (fixed + per_row * rows) / per_row))

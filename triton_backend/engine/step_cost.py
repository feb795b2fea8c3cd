"""How long a step takes for how many rows: a line fitted online, to size prefill chunks.

A step's time is modelled as `fixed + per_row * rows`, fitted by exponentially weighted least
squares over recent steps (old steps fade, so the fit follows the machine's load). A line needs
steps of different sizes; while they all had about one size (a batch that settled into one
shape) the last good line stands, and before any, a prior split (`PRIOR_FIXED_ROWS`: the fixed
part costs as much as that many rows, about a small model's on a CPU; far more on a GPU). Reading
an unknown split as all per-row cost instead sized prefill chunks at a row or two beside each
decode, which kept every step the same size, so the line never came: a 2,048-token prompt beside
four streams took 40 s to its first token. On a GPU, or
a CPU reading weights from memory, most of a decode step is the fixed part and a prefill chunk
rides along almost free; on a compute-bound CPU every row costs about the same. The scheduler
asks `extra_rows`: how many prefill rows a step may carry beside its decoding rows and stay
within a step time (the target inter-token latency).
"""
from __future__ import annotations


PRIOR_FIXED_ROWS = 8.0


class StepCostModel:
    def __init__(self, decay: float = 0.98, min_steps: int = 8) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._line: tuple[float, float] | None = None  # the last good fit

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

        When the recent steps had (almost) one row count, or their fit is not a rising line, the
        last good line stands; before any, the mean step read with the prior split.
        """
        if self.num_steps < self.min_steps:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        variance = self._sxx / self._n - mean_x * mean_x
        if variance >= 0.25:
            per_row = (self._sxy / self._n - mean_x * mean_y) / variance
            fixed = mean_y - per_row * mean_x
            if per_row > 0 and fixed >= 0:
                self._line = (fixed, per_row)
        if self._line is not None:
            return self._line
        per_row = mean_y / (PRIOR_FIXED_ROWS + mean_x)
        return PRIOR_FIXED_ROWS * per_row, per_row

    def predict(self, rows: int) -> float | None:
        """Seconds a step of `rows` rows is predicted to take, or None before the fit."""
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * rows

    def extra_rows(self, rows: int, seconds: float | None, steps: float) -> int:
        """Rows a step of `rows` decoding rows may add and stay within `seconds`, or, when
        `seconds` is None, within `steps` times its own time (at least 1, so a prefill always
        moves on). Before the fit, in units of a row with the prior split: `steps` - 1 times
        (PRIOR_FIXED_ROWS + rows) whatever `seconds` says."""
        fit = self.fit()
        if fit is None:
            return max(1, int((steps - 1.0) * (PRIOR_FIXED_ROWS + rows)))
        fixed, per_row = fit
        budget = steps * (fixed + per_row * rows) if seconds is None else seconds
        return max(1, int((budget - fixed - per_row * rows) / per_row + 1e-6))  # float noise

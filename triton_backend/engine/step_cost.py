"""How long a step takes for how many rows and how much attention: a plane fitted online, to size
prefill chunks.

A step's time is modelled as `fixed + per_row * rows + per_key * keys`, where `keys` counts the
(query row, cached key) pairs its attention reads: a row at position p attends p + 1 keys, so a
chunk of n rows from position s reads n * s + n * (n + 1) / 2 of them. The fit is exponentially
weighted least squares over recent steps (old steps fade, so it follows the machine's load). The
attention term matters on long prompts: with a line alone, chunks of one size took 195 ms at the
head of a 2,048-token prompt and 297 ms at its tail, and an explicit target was overshot by a
fifth there. When the recent steps cannot tell keys from rows (no keys reported, or keys that
move with the rows) the fit is a line (`per_key` 0); a line needs steps of different sizes.
While they all had about one size (a batch that settled into one shape) the last good fit
stands, and before any, a prior split (`PRIOR_FIXED_ROWS`: the fixed part costs as much as that
many rows, about a small model's on a CPU; far more on a GPU). Reading an unknown split as all
per-row cost instead sized prefill chunks at a row or two beside each decode, which kept every
step the same size, so the line never came: a 2,048-token prompt beside four streams took 40 s
to its first token. On a GPU, or a CPU reading weights from memory, most of a decode step is the
fixed part and a prefill chunk rides along almost free; on a compute-bound CPU every row costs
about the same. The scheduler asks `extra_rows`: how many prefill rows a step may carry beside
its decoding rows and stay within a step time (the target inter-token latency).
"""
from __future__ import annotations

import math
from typing import NamedTuple

PRIOR_FIXED_ROWS = 8.0
MIN_ROW_VARIANCE = 0.25  # rows' weighted variance below which the steps had one size
MAX_KEY_CORRELATION = 0.98  # keys moving this closely with rows say nothing of their own


class StepCost(NamedTuple):
    fixed: float           # seconds a step costs whatever it carries
    per_row: float         # seconds per row (weights, MLP, sampling)
    per_key: float = 0.0   # seconds per attended (row, key) pair

    def seconds(self, rows: int, keys: int = 0) -> float:
        return self.fixed + self.per_row * rows + self.per_key * keys


def keys_of(start: int, rows: int) -> int:
    """(row, key) pairs a chunk of `rows` rows from position `start` attends (causal)."""
    return rows * start + rows * (rows + 1) // 2


class StepCostModel:
    def __init__(self, decay: float = 0.98, min_steps: int = 8) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        # weighted sums of 1, rows (x), keys (k), seconds (y) and their products
        self._n = self._sx = self._sk = self._sy = 0.0
        self._sxx = self._sxk = self._skk = self._sxy = self._sky = 0.0
        self._good: StepCost | None = None  # the last good fit

    def observe(self, rows: int, seconds: float, keys: int = 0) -> None:
        if rows <= 0 or not seconds > 0:
            return
        d = self.decay
        self.num_steps += 1
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + rows
        self._sk = self._sk * d + keys
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + rows * rows
        self._sxk = self._sxk * d + rows * keys
        self._skk = self._skk * d + keys * keys
        self._sxy = self._sxy * d + rows * seconds
        self._sky = self._sky * d + keys * seconds

    def fit(self) -> StepCost | None:
        """The step's cost, or None before `min_steps` steps.

        The plane when the recent steps tell keys from rows and it rises with both, else the
        line over rows; when neither is good (one step size, or a falling fit) the last good fit
        stands; before any, the mean step read with the prior split.
        """
        if self.num_steps < self.min_steps:
            return None
        n = self._n
        mx, mk, my = self._sx / n, self._sk / n, self._sy / n
        vxx = self._sxx / n - mx * mx
        if vxx >= MIN_ROW_VARIANCE:
            fit = self._plane(mx, mk, my, vxx) or self._line(mx, my, vxx)
            if fit is not None:
                self._good = fit
        if self._good is not None:
            return self._good
        per_row = my / (PRIOR_FIXED_ROWS + mx)
        return StepCost(PRIOR_FIXED_ROWS * per_row, per_row)

    def _line(self, mx: float, my: float, vxx: float) -> StepCost | None:
        per_row = (self._sxy / self._n - mx * my) / vxx
        fixed = my - per_row * mx
        return StepCost(fixed, per_row) if per_row > 0 and fixed >= 0 else None

    def _plane(self, mx: float, mk: float, my: float, vxx: float) -> StepCost | None:
        n = self._n
        vkk = self._skk / n - mk * mk
        vxk = self._sxk / n - mx * mk
        if vkk <= 1e-4 * mk * mk or vxk * vxk >= MAX_KEY_CORRELATION ** 2 * vxx * vkk:
            return None
        cxy, cky = self._sxy / n - mx * my, self._sky / n - mk * my
        det = vxx * vkk - vxk * vxk
        per_row = (cxy * vkk - cky * vxk) / det
        per_key = (cky * vxx - cxy * vxk) / det
        fixed = my - per_row * mx - per_key * mk
        if per_row > 0 and per_key > 0 and fixed >= 0:
            return StepCost(fixed, per_row, per_key)
        return None

    def predict(self, rows: int, keys: int = 0) -> float | None:
        """Seconds a step of `rows` rows attending `keys` keys is predicted to take, or None
        before the fit."""
        fit = self.fit()
        return None if fit is None else fit.seconds(rows, keys)

    def extra_rows(self, rows: int, seconds: float | None, steps: float, keys: int = 0,
                   start: int = 0) -> int:
        """Prefill rows a step of `rows` decoding rows (attending `keys` keys) may add, from
        position `start` of a prompt, and stay within `seconds`, or, when `seconds` is None,
        within `steps` times its own time (at least 1, so a prefill always moves on). Before the
        fit, in units of a row with the prior split: `steps` - 1 times (PRIOR_FIXED_ROWS + rows)
        whatever `seconds` says."""
        fit = self.fit()
        if fit is None:
            return max(1, int((steps - 1.0) * (PRIOR_FIXED_ROWS + rows)))
        decode = fit.seconds(rows, keys)
        left = (steps * decode if seconds is None else seconds) - decode
        if left <= 0:
            return 1
        # r rows from `start` cost per_row * r + per_key * (r * start + r * (r + 1) / 2)
        a = fit.per_key / 2
        b = fit.per_row + fit.per_key * (start + 0.5)
        extra = left / b if a == 0 else 2 * left / (b + math.sqrt(b * b + 4 * a * left))
        return max(1, int(extra + 1e-6))  # float noise

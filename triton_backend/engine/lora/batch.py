"""Batched LoRA for one step: one base GEMM for every row, then per adapter a small pair of
GEMMs over the contiguous rows that use it (`out[rows] += x[rows] @ A^T @ B^T`).

The runner packs the chunks of one adapter next to each other (`group_by_adapter`), so each
adapter covers one run of rows per attention group (at most two runs). No weights are merged:
the base projection stays shared by every request of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_backend.engine.lora.cache import ResidentAdapter

# From this many rows on, a run takes the packed bf16 kernel when the adapter has it; below, the
# float32 GEMMs are faster (one row: 8 us vs 12 us per pair here).
PACKED_MIN_ROWS = 4


@dataclass
class LoRARun:
    start: int
    end: int
    adapter: ResidentAdapter


class LoRABatch:
    def __init__(self, runs: list[LoRARun]) -> None:
        self.runs = runs

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each run's adapter delta of projection `module` of `layer` to `out` in place
        (`x` is the projection's input); returns `out`."""
        x32 = None
        for run in self.runs:
            pair = run.adapter.pairs.get((layer, module))
            if pair is None:
                continue
            rows = run.end - run.start
            packed = run.adapter.packed.get((layer, module)) if rows >= PACKED_MIN_ROWS else None
            if packed is None:  # A^T, B^T in float32 (see cache.py)
                a, b = pair
                if x32 is None:
                    x32 = x if x.dtype == torch.float32 else x.float()
                xs = x32 if rows == out.shape[0] else x32.narrow(0, run.start, rows)
                delta = torch.mm(torch.mm(xs, a), b)
            else:  # packed bf16 kernels
                a, b = packed
                delta = b(a(x if rows == out.shape[0] else x.narrow(0, run.start, rows)))
            # cast first: an in-place add of float32 into bfloat16 takes torch's slow
            # mixed-dtype path (~100 us per call at 16 rows, measured here)
            target = out if rows == out.shape[0] else out.narrow(0, run.start, rows)
            target.add_(delta if delta.dtype == out.dtype else delta.to(out.dtype))
        return out


def adapter_runs(row_counts: list[int], task_ids: list[int | None],
                 adapters: dict[int, ResidentAdapter]) -> list[LoRARun]:
    """Runs of consecutive packed rows sharing an adapter, from each chunk's row count and task
    id in packing order (None: the base model, no run)."""
    runs: list[LoRARun] = []
    start = 0
    for count, task_id in zip(row_counts, task_ids):
        if task_id is not None:
            if runs and runs[-1].end == start and runs[-1].adapter.task_id == task_id:
                runs[-1].end += count
            else:
                runs.append(LoRARun(start, start + count, adapters[task_id]))
        start += count
    return runs

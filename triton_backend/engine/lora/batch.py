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
            if x32 is None:  # float32 GEMMs (see cache.py), added into the activations' dtype
                x32 = x if x.dtype == torch.float32 else x.float()
            a_t, b_t = pair
            rows = run.end - run.start
            if rows == out.shape[0]:  # one adapter for the whole step: no slicing
                out.add_(torch.mm(torch.mm(x32, a_t), b_t))
            else:
                out.narrow(0, run.start, rows).add_(
                    torch.mm(torch.mm(x32.narrow(0, run.start, rows), a_t), b_t))
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

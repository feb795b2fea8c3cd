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

# The projections of a layer in the order the C++ decode path runs them (`cpu/forward.py`).
PROJECTIONS = ("qkv", "dense", "gate_up", "proj")
# From this many rows on, a run takes the packed bf16 kernel when the adapter has it; below, the
# float32 product is faster (one row: 8 us vs 12 us per pair of torch GEMMs here, and less in one
# pass of the C++ kernels' `lora_add_rows`). cpu/csrc/forward.cpp's kLoraFewRows is this.
PACKED_MIN_ROWS = 4


@dataclass
class LoRARun:
    start: int
    end: int
    adapter: ResidentAdapter


class LoRABatch:
    def __init__(self, runs: list[LoRARun], few_rows=None) -> None:
        """`few_rows`: the backend's `lora_add_rows` kernel (out, x, A^T, B^T), which runs of
        fewer than PACKED_MIN_ROWS rows take (one pass per row instead of two GEMM calls, a cast
        and an add), as the CPU backend's one-call decode path does; None: the torch path."""
        self.runs = runs
        self.few_rows = few_rows

    def kernel_arguments(self, num_layers: int) -> tuple[list[torch.Tensor | None], list[int]]:
        """The runs' weights as the C++ decode path reads them (per layer, projection and run:
        A^T and B^T (float32; as stored for a run of fewer than PACKED_MIN_ROWS rows), then A and
        B packed where `apply` would take the packed kernel, else None; four Nones where the
        adapter leaves the projection alone) and the runs' row bounds. The same choice of
        kernel per run as `apply`: the two paths compute alike."""
        slots: list[torch.Tensor | None] = []
        for layer in range(num_layers):
            for module in PROJECTIONS:
                for run in self.runs:
                    pair = run.adapter.pairs.get((layer, module))
                    if pair is None:
                        slots += [None] * 4
                        continue
                    if run.end - run.start < PACKED_MIN_ROWS:
                        slots += [*run.adapter.few_rows_pair((layer, module)), None, None]
                        continue
                    packed = run.adapter.packed.get((layer, module))
                    slots += [*pair, *((None, None) if packed is None
                                       else (packed[0].packed, packed[1].packed))]
        return slots, [bound for run in self.runs for bound in (run.start, run.end)]

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
            if packed is None and self.few_rows is not None and rows < PACKED_MIN_ROWS:
                self.few_rows(
                    out if rows == out.shape[0] else out.narrow(0, run.start, rows),
                    x if rows == out.shape[0] else x.narrow(0, run.start, rows),
                    *run.adapter.few_rows_pair((layer, module)))
                continue
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

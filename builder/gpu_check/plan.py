"""What a `forge gpu-check` run is made of, before anything runs: its settings per device (the
shapes, concurrencies, prompt and output lengths, the run's budget), the targets it applies, and
its shape runs (each shape in the engine's dtype, and on a GPU the smaller one again in float32).
`run.py` runs them; `estimate.py` counts them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from builder.gpu_check import models, shape_checks

# The targets for the 1.07B shape on an H100-class GPU (output tok/s, in-process).
GPU_TARGETS = {1: 450.0, 16: 5000.0, 64: 15000.0}
MIN_RATIO_TO_TRANSFORMERS = 5.0
MIN_FP8_SPEEDUP = 1.3


@dataclass
class Settings:
    device: str
    work: Path
    concurrencies: list[int]
    prompt_len: int
    new_tokens: int
    shapes: tuple[models.Shape, ...]
    fp8: bool = True
    serve: bool = True
    tokenizer: Path | None = None  # a saved SmolLM2 tokenizer; None: the demo package's
    read_rate: float = 0.0  # bytes/s, measured at the start
    # The whole run's budget: on a GPU well past the estimate (5 minutes) yet inside the window
    # a device is lent for; None on a CPU, where CI's own timeout stands.
    budget_s: float | None = None

    @classmethod
    def for_device(cls, device: str, work: Path) -> "Settings":
        if device == "cuda":
            return cls(device, work, [1, 16, 64], 128, 128, models.GPU_SHAPES, budget_s=420.0)
        return cls(device, work, [1, 4], 32, 12, models.CPU_SHAPES)



def shape_runs(settings: Settings) -> list[shape_checks.ShapeRun]:
    """Each shape in the engine's dtype (bf16 on a GPU: the close rule, float32 on a CPU: the
    exact one), and on a GPU the smaller shape once more in float32 for the exact rule."""
    gpu = settings.device == "cuda"
    runs = [shape_checks.ShapeRun(shape, "bfloat16" if gpu else "float32")
            for shape in settings.shapes]
    if gpu:
        runs.append(shape_checks.ShapeRun(settings.shapes[0], "float32", measure_speed=False,
                                          companion=True))
    return runs

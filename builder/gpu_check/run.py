"""`forge gpu-check`: prove the engine on a GPU (or, with `--device cpu`, run the same checks on
small shapes here, the GPU backend's step on the CPU) and write one JSON, print one table.

Per shape (`shape_checks.py`): a random-weight checkpoint and its engine (`forge engine`),
transformers' reference, our engine loaded once, parity with transformers on the same device
(prefill logits; greedy ids of a batch with a prefix-cache hit, without the captured decode steps
and with them), the engine's output tok/s at each concurrency beside transformers' `generate`
and the memory roofline; then FP8 weights against bf16 on the largest shape, and `forge serve`
through the OpenAI endpoint where `tritonserver` imports. Each is a check of the ledger
(`ledger.py`: its own budget, its time and counts, the report written after it). Checks with
targets decide the exit code, and so does a check that failed or ran out of time; on a CPU the
speed targets are reported, not applied. `estimate.py` turns the counts into the cold GPU run's
expected time.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from builder.gpu_check import estimate, models, shape_checks, speed
from builder.gpu_check.fused_ops import check_fused_ops
from builder.gpu_check.ledger import Ledger, count
from builder.gpu_check.plan import (GPU_TARGETS, MIN_FP8_SPEEDUP, MIN_RATIO_TO_TRANSFORMERS,
                                    Settings, shape_runs)
from triton_backend.engine.gpu.graphs import CAPTURE_SIZES_ENV
from triton_backend.engine.gpu.variants import VARIANTS

@dataclass
class Report:
    settings: Settings
    shapes: dict = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    ledger: Ledger | None = None
    _machine: dict | None = None

    def check(self, name: str, passed: bool, value, target: str, applied: bool = True) -> None:
        self.checks.append({"name": name, "passed": bool(passed), "value": value,
                            "target": target, "applied": applied})

    @property
    def passed(self) -> bool:
        broken = self.ledger is not None and any(
            r.status in ("failed", "timed out", "not run") for r in self.ledger.records)
        return not broken and all(c["passed"] for c in self.checks if c["applied"])

    def to_dict(self) -> dict:
        s = self.settings
        if self._machine is None:
            self._machine = machine(s.device)
        ledger = {}
        if self.ledger is not None:
            totals = self.ledger.totals()
            ledger = {"ledger": self.ledger.to_list(), "totals": totals,
                      "cold_gpu_estimate": estimate.cold_gpu_run(s, totals)}
        return {"device": s.device, "machine": self._machine, "work": str(s.work),
                "concurrencies": s.concurrencies, "prompt_len": s.prompt_len,
                "new_tokens": s.new_tokens, "shapes": self.shapes, **self.extra,
                "checks": self.checks, **ledger, "passed": self.passed}


def machine(device: str) -> dict:
    from builder.bench.summary import cpu_line, host

    info = {"torch": torch.__version__, "cpu": cpu_line(host())}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


@dataclass(frozen=True)
class Targets:
    tok_s: dict[int, float]
    min_ratio: float


TARGETS = Targets(GPU_TARGETS, MIN_RATIO_TO_TRANSFORMERS)
# Each check's budget in seconds, on a GPU (the planned cold run fits 5 minutes: estimate.py)
# and on a CPU (the small shapes on 2 cores, the C++ kernels built already).
BUDGETS = {"build": (60, 240), "transformers": (30, 120), "engine load": (30, 120),
           "parity eager": (15, 120), "graph capture": (15, 60), "parity graphs": (15, 120),
           "speed": (30, 120), "fused ops": (20, 30), "fp8 build and gate": (150, 300),
           "fp8 speed": (30, 120), "served": (60, 300)}


def _budget(settings: Settings, check: str) -> float:
    return BUDGETS[check][0 if settings.device == "cuda" else 1]


def run_checks(settings: Settings, say: Callable[[str], None],
               write: Callable[[Report], None] = lambda report: None) -> Report:
    """Every check in order through one ledger; `write(report)` after each."""
    if settings.device == "cpu":  # the GPU backend's step, its kernels' references
        os.environ["LLM_FORGE_KERNELS"] = "gpu"
    else:  # float32 means float32: the exact rule's GEMMs without TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # Capture only the batch sizes the checks run: the parity batch (3 rows, then 1) and each
    # concurrency; serving captures many more.
    os.environ.setdefault(CAPTURE_SIZES_ENV, ",".join(
        str(c) for c in estimate.capture_sizes(settings)))
    report = Report(settings)
    ledger = Ledger(lambda: write(report), say, total_s=settings.budget_s)
    report.ledger = ledger
    VARIANTS.hook_compiles()
    settings.read_rate = speed.memory_read_rate(settings.device)
    report.extra["memory_read_gb_s"] = settings.read_rate / 1e9
    say(f"memory read rate {settings.read_rate / 1e9:.0f} GB/s")
    if settings.tokenizer is None or not (settings.tokenizer / "tokenizer_config.json").is_file():
        settings.tokenizer = models.save_tokenizer(settings.work / "tokenizer", settings.tokenizer)
    for run in shape_runs(settings):
        _shape(run, settings, report, ledger)
        if not run.companion:
            largest = run
    ledger.run("fused ops", _budget(settings, "fused ops"),
               lambda: check_fused_ops(largest.shape, settings, report))
    if settings.fp8:
        fp8 = {}
        ledger.run(f"{largest.shape.name}: fp8 build and gate", _budget(settings, "fp8 build and gate"),
                   lambda: _fp8_build(largest, settings, report, ledger.remaining, fp8))
        ledger.run(f"{largest.shape.name}: fp8 speed", _budget(settings, "fp8 speed"),
                   lambda: _fp8_speed(largest, settings, report, fp8))
    if settings.serve:
        from builder.gpu_check.served import check_served

        ledger.run("served", _budget(settings, "served"),
                   lambda: check_served(largest.need("engine_dir"), settings, report, say,
                                        ledger.remaining))
    return report


def _shape(run: shape_checks.ShapeRun, settings: Settings, report: Report, ledger: Ledger) -> None:
    name = run.name
    say = ledger.say
    say(f"{name}: {run.shape.parameters / 1e9:.2f}B parameters, {run.dtype}")
    steps = [("build", lambda: shape_checks.build(run, settings, ledger.remaining)),
             ("transformers", lambda: shape_checks.reference(run, settings)),
             ("engine load", lambda: shape_checks.load(run, settings)),
             ("parity eager", lambda: shape_checks.parity_eager(run, report)),
             ("graph capture", lambda: shape_checks.capture(run)),
             ("parity graphs", lambda: shape_checks.parity_graphs(run, report)),
             ("speed", lambda: shape_checks.throughput(run, settings, report, TARGETS))]
    if not run.measure_speed:
        steps.pop()
    report.shapes[name] = run.result
    for check, step in steps:
        ledger.run(f"{name}: {check}", _budget(settings, check), step)
    shape_checks.close(run, settings)


def _fp8_build(run: shape_checks.ShapeRun, settings: Settings, report: Report, remaining,
               fp8: dict) -> None:
    """The FP8 engine (ModelOpt) through the quality gate, as any quantized build. An engine
    the gate rejects is kept and still measured. The gate is applied on a GPU; on a CPU's small
    random shapes it is reported: there FP8's rounding is as large as the gaps between a random
    model's top logits on real text, so its top-1 agreement says little about FP8 itself."""
    shape = run.shape
    try:
        fp8["engine_dir"] = models.build_engine(
            shape, run.need("checkpoint"), settings.work, settings.device, weights="fp8",
            max_batch_size=max(settings.concurrencies), quick_gate=settings.device == "cpu",
            timeout=remaining())
    except models.GateRejected as exc:
        fp8["engine_dir"] = exc.kept
    except RuntimeError as exc:
        report.extra["fp8"] = {"error": str(exc)[-2000:]}
        report.check(f"{shape.name} FP8 build", False, "failed", "an engine")
        raise
    report.check(f"{shape.name} FP8 build", True, fp8["engine_dir"].name, "an engine")
    quality = json.loads((fp8["engine_dir"] / "quality.json").read_text())
    report.extra["fp8"] = {"quality": quality, "engine": fp8["engine_dir"].name}
    report.check(f"{shape.name} FP8 gate", not quality.get("failures"),
                 quality.get("failures") or "passed", "passes",
                 applied=settings.device == "cuda")


def _fp8_speed(run: shape_checks.ShapeRun, settings: Settings, report: Report, fp8: dict) -> None:
    """FP8 against bf16 at the largest concurrency: bf16's figure is the shape's own speed."""
    from triton_backend.engine.llm_engine import LLMEngine

    if "engine_dir" not in fp8:
        raise shape_checks.Skipped("needs the FP8 engine, which its build did not give")
    c = max(settings.concurrencies)
    bf16 = next((row for row in run.result["speed"] if row["concurrency"] == c), None)
    if bf16 is None:
        raise shape_checks.Skipped(f"needs the bf16 speed at c={c}, which its check did not give")
    count("engine_loads")
    engine = LLMEngine(fp8["engine_dir"], device=settings.device)
    count("graph_captures", len(engine.runner.ops.graphs.sizes) if engine.runner.ops.graphs else 0)
    kernels = fp8_kernels(engine.runner.model)
    ours = speed.engine_throughput(engine, [c], settings.prompt_len, settings.new_tokens,
                                   run.shape.vocab_size, settings.device)[0]
    del engine
    shape_checks.free(settings.device)
    ratio = ours["tok_s"] / bf16["tok_s"]
    report.extra.setdefault("fp8", {}).update(concurrency=c, bf16=bf16, fp8=ours, speedup=ratio,
                                              kernels=kernels)
    report.check(f"{run.shape.name} FP8 >= {MIN_FP8_SPEEDUP:g}x bf16 at c={c}",
                 ratio >= MIN_FP8_SPEEDUP, round(ratio, 2), f">= {MIN_FP8_SPEEDUP:g}x",
                 applied=settings.device == "cuda")


def fp8_kernels(model) -> dict[str, int]:
    """How many FP8 projections run each kernel here: `scaled_mm` (FP8 tensor cores) or
    `dequant` (the weight widened per call, where FP8 GEMMs are not native)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, str):
            counts[kernel] = counts.get(kernel, 0) + 1
    return counts

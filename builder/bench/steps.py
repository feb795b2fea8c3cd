"""`forge bench steps`: decode-step time of several engines at given concurrencies and context
length, in turns (where a one-byte KV cache shows: at long contexts a step reads more keys and
values than weights), quiet or beside a busy neighbour. `forge bench spec`: speculation on the
copy task (the `rewrite` workload's prompts, greedy, one request at a time), the same engine with
drafts and without."""
from __future__ import annotations

import statistics
from typing import Any

import torch

from builder.bench import inprocess
from builder.bench.summary import Table, document, ratio_cell


def _kv_name(engine: Any) -> str:
    kv = engine.runner.kv_cache.k.dtype
    return engine.config.kv_cache.dtype if kv in (torch.int8, torch.uint8) else str(kv)[6:]


def run_steps(engines: dict[str, str], concurrencies: list[int], prompt_len: int, steps: int,
              repeats: int, conditions: tuple[str, ...]) -> dict[str, Any]:
    loaded = {name: inprocess.load(path) for name, path in engines.items()}
    vocab = min(e.config.model.vocab_size for e in loaded.values())
    prompts = inprocess.random_prompts(vocab, max(concurrencies), prompt_len)
    cases = {(name, c): (lambda e=engine, c=c: statistics.median(
        inprocess.step_times(e, prompts[:c], steps)))
        for c in concurrencies for name, engine in loaded.items()}
    keyed = {f"{name} c={c}": run for (name, c), run in cases.items()}
    runs = inprocess.in_turns(keyed, repeats, conditions)
    reference = next(iter(loaded))
    table = Table(["engine", "KV cache", "concurrency"]
                  + [f"{k} step ms" if k != "quiet" else "step ms" for k in conditions]
                  + ["tok/s", f"vs {reference} (repeats)"]
                  + (["busy / quiet step"] if "busy" in conditions else []))
    for (name, c) in cases:
        by = runs[f"{name} c={c}"]
        quiet = by[conditions[0]]
        base = runs[f"{reference} c={c}"][conditions[0]]
        table.add(name, _kv_name(loaded[name]), c,
                  *(f"{statistics.median(by[k]) * 1e3:.1f}" for k in conditions),
                  f"{c / statistics.median(quiet):.1f}",
                  "" if name == reference else ratio_cell(base, quiet),
                  *([ratio_cell(by["busy"], by["quiet"])] if "busy" in conditions else []))
    return document("forge bench steps", {
        "engines": engines, "concurrencies": concurrencies, "prompt_len": prompt_len,
        "steps": steps, "repeats": repeats, "conditions": list(conditions),
        "torch_threads": torch.get_num_threads()}, [table],
        [f"{steps} decode steps timed one by one after {prompt_len}-token prompts; medians of "
         f"{repeats} repeats' medians; ratios are speedups (the reference's step / this one's)"],
        runs_step_s=runs)


def run_spec(engine_dir: str, num_prompts: int, scale: float, max_tokens: int, repeats: int,
             conditions: tuple[str, ...]) -> dict[str, Any]:
    from builder.bench.workloads import build_workload, load_tokenizer

    tokenizer = load_tokenizer(engine_dir)
    prompts = [tokenizer.encode(item.prompt) for item in
               build_workload("rewrite", num_prompts, scale=scale, tokenizer=tokenizer).items]
    engines = {name: inprocess.load(engine_dir, enable_speculative_decoding=on)
               for name, on in (("speculation", True), ("none", False))}
    runs = inprocess.in_turns({name: lambda e=e: inprocess.copy_rate(e, prompts, max_tokens)
                               for name, e in engines.items()}, repeats, conditions)
    table = Table(["condition", "speculation tok/s", "none tok/s",
                   "speculation / none (repeats)"])
    for k in conditions:
        spec, none = runs["speculation"][k], runs["none"][k]
        table.add(k, f"{statistics.median(spec):.1f}", f"{statistics.median(none):.1f}",
                  ratio_cell(spec, none))
    notes = [f"{num_prompts} rewrite prompts one at a time, {max_tokens} tokens each, greedy; "
             f"decode tok/s after each one's first token; medians of {repeats}"]
    if "busy" in conditions:
        notes += [f"{name} busy / quiet: {ratio_cell(by['busy'], by['quiet'])}"
                  for name, by in runs.items()]
    return document("forge bench spec", {
        "engine": engine_dir, "prompts": num_prompts, "scale": scale, "max_tokens": max_tokens,
        "repeats": repeats, "conditions": list(conditions), "torch_threads": torch.get_num_threads()}, [table], notes, runs_tok_s=runs)

"""`forge bench chunked-prefill`: do running streams keep streaming while a long prompt is
prefilled? `streams` sequences decode; then a prompt of max_num_tokens x `long_factor` tokens
arrives and is prefilled in chunks within the per-step budget. Every step hands each stream one
token, so a stream's inter-token latency is the step that produced it. Per (max_num_tokens,
target_itl_ms) setting: the streams' ITL p50 before the prompt (steady), their ITL p99 while it
is prefilled, the ratio, and the prompt's TTFT; settings in turns, medians over repeats."""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

import numpy as np
import torch

from builder.bench import inprocess
from builder.bench.summary import Table, document
from triton_backend.engine import Request


def _timed_step(engine: Any) -> tuple[float, list]:
    start = time.perf_counter()
    responses = engine.step()
    return time.perf_counter() - start, responses


def one_run(engine: Any, budget: int, target: float | str, streams: int, long_factor: int,
            steady_steps: int, rng: random.Random) -> dict[str, Any]:
    """The streams' ITLs (s) before and during the long prefill, and its TTFT (s)."""
    engine.scheduler.max_num_tokens, engine.scheduler.target_itl_ms = budget, target
    vocab, long_len = engine.config.model.vocab_size, budget * long_factor
    horizon = steady_steps + 4 * long_factor + 64  # tokens each stream may need
    for _ in range(streams):
        engine.add_request(Request([rng.randrange(vocab) for _ in range(16)], horizon,
                                   streaming=True, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()  # the streams' own prefills are not part of the measurement
    steady = [_timed_step(engine)[0] for _ in range(steady_steps)]
    long_id = engine.add_request(Request([rng.randrange(vocab) for _ in range(long_len)], 1,
                                         ignore_eos=True))
    during, arrived = [], time.perf_counter()
    while True:
        seconds, responses = _timed_step(engine)
        during.append(seconds)
        if any(r.request_id == long_id for r in responses):
            break
    ttft = time.perf_counter() - arrived
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    return {"steady_itl_p50_s": float(np.percentile(steady, 50)),
            "prefill_itl_p99_s": float(np.percentile(during, 99)), "long_ttft_s": ttft,
            "long_prompt_tokens": long_len, "prefill_steps": len(during)}


def run(engine_dir: str, budgets: list[int] | None, targets: list[float | str] | None,
        streams: int, long_factor: int, steady_steps: int, repeats: int) -> dict[str, Any]:
    # Nothing may be skipped: every prompt computed, no drafts.
    engine = inprocess.load(engine_dir, enable_speculative_decoding=False)
    limits = engine.config.limits
    budgets = budgets or [limits.max_num_tokens]
    for budget in budgets:
        if budget <= streams:
            raise ValueError(f"--max-num-tokens {budget}: the {streams} decoding streams would "
                             f"take the whole budget and the prompt would never be prefilled")
        if budget * long_factor > limits.max_input_len:
            raise ValueError(f"--max-num-tokens {budget}: a {budget * long_factor}-token prompt "
                             f"exceeds the engine's max_input_len {limits.max_input_len}")
    settings = [(b, t) for b in budgets for t in dict.fromkeys(targets or [0, limits.target_itl_ms])]
    rng = random.Random(0)
    for budget, target in settings:  # warm-up (and a first step-time fit)
        one_run(engine, budget, target, streams, long_factor, 4, rng)
    cases = {f"{b} / {t if t == 'auto' else format(t, 'g')}": (
        lambda b=b, t=t: one_run(engine, b, t, streams, long_factor, steady_steps, rng))
        for b, t in settings}
    runs = inprocess.in_turns(cases, repeats)
    table = Table(["max_num_tokens / target_itl_ms", "long prompt", "prefill steps",
                   "steady ITL p50 ms", "ITL p99 during prefill ms", "ratio",
                   "long prompt TTFT ms"])
    for key, by in runs.items():
        r = by["quiet"]
        med = {k: statistics.median(x[k] for x in r) for k in r[0]}
        ratio = statistics.median(x["prefill_itl_p99_s"] / x["steady_itl_p50_s"] for x in r)
        table.add(key, r[0]["long_prompt_tokens"], f"{med['prefill_steps']:g}",
                  f"{med['steady_itl_p50_s'] * 1e3:.1f}", f"{med['prefill_itl_p99_s'] * 1e3:.1f}",
                  f"{ratio:.2f}", f"{med['long_ttft_s'] * 1e3:.0f}")
    return document("forge bench chunked-prefill", {
        "engine": engine_dir, "streams": streams, "long_factor": long_factor,
        "steady_steps": steady_steps, "repeats": repeats,
        "torch_threads": torch.get_num_threads()}, [table],
        [f"{streams} streams decoding while a prompt of max_num_tokens x {long_factor} is "
         f"prefilled; medians of {repeats} interleaved runs"],
        runs={k: v["quiet"] for k, v in runs.items()})

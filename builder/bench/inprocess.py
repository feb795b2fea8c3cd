"""The in-process engine protocol every engine-level and feature subcommand shares: seeded random
prompts, end ids ignored, the engine stepped on this thread as the engine process steps it, no
prefix cache (repeats send the same prompts); what each times: a decode step with every sequence
decoding, tokens over a whole run, one prefill alone, a closed loop of a shape, the copy task.
`in_turns` runs cases interleaved over repeats, quiet or beside a busy neighbour."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from builder.bench.shapes import Shape
from builder.bench.stats import percentiles
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine

WARMUP_STEPS = 3
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def load(engine_dir: str, **options: Any) -> LLMEngine:
    return LLMEngine(engine_dir, **{"enable_prefix_caching": False, **options})


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist()
            for _ in range(count)]


def step_times(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps with every prompt's sequence decoding: the prompts
    are prefilled whole (the chunk throttle off), so all enter decode together."""
    target = engine.scheduler.target_itl_ms
    engine.scheduler.target_itl_ms = 0
    try:
        for prompt in prompts:
            engine.add_request(Request(prompt, WARMUP_STEPS + steps + 2, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens
                  for s in engine.sequences.values()):
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


def run_rate(engine: LLMEngine, requests: list[Request]) -> tuple[float, float]:
    """Generated tokens per second of `requests` run together, prefill included: over the wall
    time and over this process's CPU time (which another job taking a core moves less)."""
    from triton_backend.engine.offline import generate

    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = sum(len(r.output_ids) for r in generate(engine, requests))
    return (tokens / (time.perf_counter() - started),
            tokens / (time.process_time() - cpu_started))


def prefill_alone(engine: LLMEngine, tokens: int, seed: int = 0) -> tuple[float, int]:
    """Seconds to prefill one prompt of `tokens` random ids alone, and the steps it took."""
    (prompt,) = random_prompts(engine.config.model.vocab_size, 1, tokens, seed)
    engine.add_request(Request(prompt, 1, ignore_eos=True))
    steps, start = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def copy_rate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Greedy decode tok/s over the prompts one at a time, after each one's first token."""
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        engine.add_request(Request(prompt, max_tokens, streaming=True))
        first, count, after_first = None, 0, 0
        while engine.has_work():
            count += sum(len(r.output_token_ids) for r in engine.step())
            if first is None and count:
                first, after_first = time.perf_counter(), count
        tokens += count - after_first
        seconds += time.perf_counter() - (first or time.perf_counter())
    return tokens / seconds


def closed_loop(engine: LLMEngine, shape: Shape, seed: int = 0) -> dict[str, Any]:
    """`vllm bench serve`'s closed loop on the engine's own scheduler: `concurrency` requests in
    flight, a new one as one ends, `prompts` in all; tok/s, TTFT and ITL as a client with no
    server between would see them, and the step cost the scheduler learnt."""
    vocab, size, out = engine.config.model.vocab_size, shape.input_len, shape.output_len
    prompts = iter(random_prompts(vocab, shape.prompts, size, seed + 1))
    sent: dict[int, float] = {}
    tokens: dict[int, list[float]] = {}

    def send() -> None:
        rid = engine.add_request(Request(next(prompts), out, streaming=True, ignore_eos=True))
        sent[rid] = time.perf_counter()

    prefill_alone(engine, min(size, 256), seed)  # warm-up
    for _ in range(shape.concurrency):
        send()
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        responses, steps = engine.step(), steps + 1
        now = time.perf_counter()
        for response in responses:
            tokens.setdefault(response.request_id, []).extend(
                [now] * len(response.output_token_ids))
            if response.is_final and len(sent) < shape.prompts:
                send()
    elapsed = time.perf_counter() - start
    ttft = percentiles([tokens[r][0] - sent[r] for r in sent], (50, 99))
    itl = percentiles([b - a for r in sent for a, b in zip(tokens[r], tokens[r][1:])], (50, 99))
    fit = engine.scheduler.step_cost.fit()
    return {"output_tok_s": shape.prompts * out / elapsed, "ttft_p50_s": ttft["p50"],
            "itl_p50_s": itl["p50"], "itl_p99_s": itl["p99"], "steps": steps,
            "step_fixed_ms": fit[0] * 1e3 if fit else None,
            "step_per_row_ms": fit[1] * 1e3 if fit else None,
            "step_per_1k_keys_ms": fit[2] * 1e6 if fit else None}


class BusyNeighbour:
    """A `while True: pass` process pinned to the last core of this process's affinity mask for
    the length of a `with` block: a server process wanting CPU beside the engine."""

    def __init__(self) -> None:
        self.core = sorted(os.sched_getaffinity(0))[-1]

    def __enter__(self) -> "BusyNeighbour":
        self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.core)])
        time.sleep(0.3)  # started and spinning
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


def in_turns(cases: dict[str, Callable[[], Any]], repeats: int,
             conditions: tuple[str, ...] = ("quiet",), log: Callable[[str], None] = print
             ) -> dict[str, dict[str, list[Any]]]:
    """runs[case][condition]: one value per repeat. Each repeat runs every case under every
    condition back to back (the pairs a ratio divides), cases and conditions in an order that
    reverses every other repeat, so drift and first-run costs hit all alike."""
    runs: dict[str, dict[str, list[Any]]] = {c: {k: [] for k in conditions} for c in cases}
    for repeat in range(repeats):
        flip = -1 if repeat % 2 else 1
        for name in list(cases)[::flip]:
            for condition in conditions[::flip]:
                if condition == "busy":
                    with BusyNeighbour():
                        runs[name][condition].append(cases[name]())
                else:
                    runs[name][condition].append(cases[name]())
            values = ", ".join(f"{k} {_short(v[-1])}" for k, v in runs[name].items())
            log(f"repeat {repeat + 1}/{repeats} {name}: {values}")
    return runs


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "/".join(_short(v) for v in value.values() if isinstance(v, float))
    if isinstance(value, tuple):
        return "/".join(_short(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def medians(runs: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {c: {k: statistics.median(v) for k, v in by.items()} for c, by in runs.items()}

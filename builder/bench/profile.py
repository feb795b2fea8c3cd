"""`forge bench profile`: one engine's time, taken apart. Decode: `concurrency` sequences of
`prompt_len` random ids decoding, `steps` steps under `torch.profiler`, the ops by self CPU time.
Prefill (`prefill` tokens): one prompt alone (median of repeats, in as many steps as
max_num_tokens needs), its arithmetic rate (GEMM FLOPs plus causal attention) beside this CPU's
bf16 GEMM rate measured on the engine's own linear layers of layer 0 at that many rows, then the
ops of one more. Shape (`IN/OUT@C[xN]`): the closed loop `vllm bench serve` drives, in-process
(`inprocess.closed_loop`): the ceiling of the served figures."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from builder.bench import inprocess
from builder.bench.shapes import parse_shapes
from builder.bench.summary import Table, document
from triton_backend.engine import Request

ENGINE_OPTIONS = {"enable_speculative_decoding": False}


def op_table(prof: Any, runs: int, top: int) -> tuple[Table, list[dict]]:
    events = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                    key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "calls_per_run": e.count / runs,
             "self_ms_per_run": e.self_cpu_time_total / 1e3 / runs,
             "share": e.self_cpu_time_total / total} for e in events]
    table = Table(["op", "calls/run", "self ms/run", "share"])
    for row in rows[:top]:
        table.add(row["op"][:60], f"{row['calls_per_run']:.0f}", f"{row['self_ms_per_run']:.2f}",
                  f"{row['share']:.1%}")
    return table, rows


def decode(engine_dir: str, concurrency: int, prompt_len: int, steps: int, top: int) -> dict:
    engine = inprocess.load(engine_dir)
    for prompt in inprocess.random_prompts(engine.config.model.vocab_size, concurrency,
                                           prompt_len):
        engine.add_request(Request(prompt, 64, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    for _ in range(inprocess.WARMUP_STEPS):
        engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    table, rows = op_table(prof, steps, top)
    table.title = "ops of one decode step"
    calls = sum(r["calls_per_run"] for r in rows)
    return document("forge bench profile", {
        "engine": engine_dir, "mode": "decode", "concurrency": concurrency,
        "prompt_len": prompt_len, "steps": steps, "torch_threads": torch.get_num_threads()},
        [table], [f"{engine.config.name} ({engine.config.dtype}), {concurrency} sequences "
                  f"decoding after {prompt_len}-token prompts: decode step {step_ms:.1f} ms "
                  f"under the profiler, {calls:.0f} op calls per step"],
        step_ms=step_ms, ops=rows)


def _weights(module) -> int:
    """in x out summed over the leaf linear layers under `module`."""
    return sum(m.in_features * m.out_features for m in module.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features")
               and not list(m.children()))


def linear_flops(engine: Any, tokens: int) -> tuple[float, float]:
    """FLOPs of a prefill of `tokens` rows: every layer's GEMMs (of a mixture of experts, the
    routed experts only: top_k of them a row; the LM head for the last row only) and causal
    attention (QK^T and PV over the keys before each row)."""
    shape = engine.config.model
    model = engine.runner.model
    per_row = _weights(model)
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if experts is not None and getattr(module, "top_k", None):
            per_row -= _weights(experts) * (1 - module.top_k / len(experts))
    head = shape.vocab_size * shape.hidden_size
    own_head = _weights(model.lm_head) if model.lm_head is not None else 0  # tied: the embedding
    gemm = 2.0 * (per_row - own_head) * tokens + 2.0 * head
    attention = 2.0 * 2 * shape.num_hidden_layers * shape.q_size * tokens * (tokens + 1) / 2
    return gemm, attention


def gemm_rates(engine: Any, rows: int) -> dict[str, float]:
    """GFLOP/s of layer 0's linear layers at `rows` rows of the model's dtype, best of 5 each."""
    dtype = next(engine.runner.model.parameters()).dtype
    layer = next(m for name, m in engine.runner.model.named_modules() if name.endswith("layers.0"))
    rates = {}
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


def op_rates(rows: list[dict], gemm: float, attention: float) -> dict:
    """GFLOP/s of the profiled prefill's GEMMs and attention, by their ops' self time."""
    def seconds(*names: str) -> float:
        return sum(r["self_ms_per_run"] for r in rows if any(n in r["op"] for n in names)) / 1e3

    total = sum(r["self_ms_per_run"] for r in rows) / 1e3
    attention_s = seconds("prefill_attention", "scaled_dot_product")
    return {"gemm_gflops": gemm / max(seconds("linear", "addmm", "aten::mm"), 1e-9) / 1e9,
            "attention_gflops": attention / max(attention_s, 1e-9) / 1e9,
            "attention_share": attention_s / max(total, 1e-9)}


def prefill(engine_dir: str, tokens: int, repeats: int, top: int,
            torch_attention: bool = False) -> dict:
    """`torch_attention`: each timed prefill again with torch's SDPA attending its long chunks
    (the path before the prefill kernel), in turns."""
    engine = inprocess.load(engine_dir, **ENGINE_OPTIONS)
    engine.scheduler.target_itl_ms = 0
    inprocess.prefill_alone(engine, min(tokens, 256))  # warm-up
    with torch.inference_mode():
        rates = gemm_rates(engine, tokens)
    timed, baseline = [], []
    for i in range(repeats):
        timed.append(inprocess.prefill_alone(engine, tokens, seed=i + 1))
        if torch_attention:
            engine.runner.ops.inputs.kernel_attention = False
            baseline.append(inprocess.prefill_alone(engine, tokens, seed=i + 1)[0])
            engine.runner.ops.inputs.kernel_attention = True
    seconds = statistics.median(t for t, _ in timed)
    gemm, attention = linear_flops(engine, tokens)
    peak, achieved = max(rates.values()), (gemm + attention) / seconds / 1e9
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        inprocess.prefill_alone(engine, tokens)
    table, rows = op_table(prof, 1, top)
    table.title = f"ops of one {tokens}-token prefill"
    config = engine.config
    notes = [f"{config.name} ({config.dtype}), one {tokens}-token prefill alone in {timed[0][1]} "
             f"step(s) (max_num_tokens {config.limits.max_num_tokens})",
             f"prefill: {seconds * 1e3:.0f} ms median of {repeats} ({tokens / seconds:.0f} tok/s);"
             f" {gemm / 1e9:.1f} GFLOP of GEMMs + {attention / 1e9:.1f} of attention = "
             f"{achieved:.1f} GFLOP/s",
             "GEMM of layer 0's linears at that many rows: "
             + ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
             + f" GFLOP/s; peak {peak:.1f}",
             f"prefill at {achieved / peak:.0%} of the measured GEMM peak"]
    ops = op_rates(rows, gemm, attention)
    notes.append(f"in the profiled prefill: GEMMs {ops['gemm_gflops']:.1f} GFLOP/s, attention "
                 f"{ops['attention_gflops']:.1f} GFLOP/s ({ops['attention_gflops'] / peak:.0%} of "
                 f"the GEMM peak, {ops['attention_share']:.0%} of the profiled time)")
    if baseline:
        before = statistics.median(baseline)
        notes.append(f"with torch's SDPA for attention, in turns: {before * 1e3:.0f} ms median; "
                     f"the prefill kernel's prefill is {before / seconds:.2f}x faster")
    return document("forge bench profile", {
        "engine": engine_dir, "mode": "prefill", "prefill_tokens": tokens, "repeats": repeats,
        "torch_threads": torch.get_num_threads()}, [table], notes,
        prefill_ms=seconds * 1e3, runs=timed, gemm_gflop=gemm / 1e9,
        attention_gflop=attention / 1e9, achieved_gflops=achieved, gemm_gflops_by_layer=rates,
        peak_gflops=peak, share_of_peak=achieved / peak, torch_attention_runs=baseline, **ops,
        ops=rows)


def shape_loop(engine_dir: str, text: str, target_itl_ms: str | None) -> dict:
    (shape,) = parse_shapes(text, "--shape")
    if shape.range_ratio:
        raise ValueError(f"--shape: {text!r}: mixed lengths (~R) are not run in-process")
    engine = inprocess.load(engine_dir, **ENGINE_OPTIONS)
    if target_itl_ms is not None:
        engine.scheduler.target_itl_ms = (target_itl_ms if target_itl_ms == "auto"
                                          else float(target_itl_ms))
    figures = inprocess.closed_loop(engine, shape)
    table = Table(["shape", "target_itl_ms", "out tok/s", "TTFT p50 s", "ITL p50 ms",
                   "ITL p99 ms", "p99 / p50", "steps"])
    table.add(f"{shape.label} x{shape.prompts}", engine.scheduler.target_itl_ms,
              f"{figures['output_tok_s']:.1f}", f"{figures['ttft_p50_s']:.1f}",
              f"{figures['itl_p50_s'] * 1e3:.0f}", f"{figures['itl_p99_s'] * 1e3:.0f}",
              f"{figures['itl_p99_s'] / figures['itl_p50_s']:.1f}", figures["steps"])
    fit = ", ".join(f"{k} {figures[k]:.3f}" for k in ("step_fixed_ms", "step_per_row_ms",
                                                      "step_per_1k_keys_ms") if figures[k])
    return document("forge bench profile", {
        "engine": engine_dir, "mode": "shape", "shape": text,
        "target_itl_ms": engine.scheduler.target_itl_ms,
        "torch_threads": torch.get_num_threads()}, [table],
        [f"{engine.config.name}, in-process closed loop; step cost learnt: {fit or 'none'}"],
        figures=figures)

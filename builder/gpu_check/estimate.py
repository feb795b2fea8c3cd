"""The cold GPU run of `make gpu-check`, estimated before one is lent.

Nothing carries over between GPU runs, so the run pays, from nothing: every Triton compile,
every graph capture, every engine build and load, and every reference run, besides the tokens
it measures. `plan_counts` says how many of each a run of given settings does; on a CPU run the
ledger's measured totals are held against the CPU plan's counts (`counts_match`), which is what
makes the GPU plan's counts, from the same code, believable. Each unit cost below is an
assumption for an H100-class host, stated in the report so that the first GPU run's ledger (the
same counts beside measured seconds) confirms or falsifies it.
"""
from __future__ import annotations

from builder.gpu_check import models, parity
from builder.gpu_check.plan import GPU_TARGETS, Settings, shape_runs

H100_SMS = 132
CPU_SMS = 4  # what the GPU backend assumes off CUDA (gpu/ops.py)
# Seconds per unit, cold, on an H100-class host (assumptions; the GPU run's ledger measures them).
UNIT_S = {
    "triton_compile": 1.2,            # one small kernel variant: Triton IR -> PTX -> cubin
    "graph_capture_per_layer": 0.004,  # one decode batch size: a warm forward and the capture
    "engine_build": 10.0,             # `forge engine` process: imports, convert, prefill check
    "engine_build_per_gb": 10.0,      # random init, save, convert and write of the weights
    "fp8_host_gate_per_gb": 30.0,     # ModelOpt calibration and the fp32 gate, on the host
    "engine_load": 3.0,
    "engine_load_per_gb": 1.5,
    "reference_step_per_layer": 0.001,  # transformers' eager decode step (launch-bound)
    "served_start": 30.0,             # tritonserver, the engine and its warm-up
}


def _gb(shape: models.Shape) -> float:
    return shape.parameters * 2 / 1e9  # bf16 (the float32 companion is the small shape)


def capture_sizes(settings) -> list[int]:
    """The decode batch sizes gpu-check captures: the parity batch (3 rows, then 1) and each
    concurrency."""
    return sorted({1, 4, *settings.concurrencies})


def _variants(settings) -> set[tuple]:
    from triton_backend.engine.gpu.warmup import planned_variant_names

    sms = H100_SMS if settings.device == "cuda" else CPU_SMS
    names: set[tuple] = set()
    for run in shape_runs(settings):
        s = run.shape
        names |= {(run.dtype, *name) for name in planned_variant_names(
            s.hidden_size, s.intermediate_size, s.num_attention_heads, s.num_key_value_heads,
            s.hidden_size // s.num_attention_heads, 16, models.MAX_SEQ_LEN, sms)}
    if settings.fp8 and settings.device == "cuda":  # the fused input quantization (gpu/fp8.py)
        from triton_backend.engine.gpu.fp8 import block_size

        largest = settings.shapes[-1]
        names |= {("quantize_fp8", block_size(width))
                  for width in (largest.hidden_size, largest.intermediate_size)}
    return names


def plan_counts(settings) -> dict[str, int]:
    """What a run of `settings` counts: one build and one load per shape run (a GPU's float32
    companion included) and the FP8 engine, the check's capture sizes per load, the kernel
    variants of its runs, the reference runs (speed runs also time `generate`)."""

    runs = shape_runs(settings)
    engines = len(runs) + (1 if settings.fp8 else 0)
    return {"engine_builds": engines, "engine_loads": engines,
            "graph_captures": engines * len(capture_sizes(settings)),
            "kernel_variants": len(_variants(settings)),
            "reference_runs": sum(parity.PARITY_PROMPTS + 1 + (2 * len(settings.concurrencies)
                                                               if run.measure_speed else 0)
                                  for run in runs)}


def cold_gpu_run(settings, totals: dict) -> dict:
    """Seconds per term and in all for the GPU plan (`Settings.for_device("cuda")` with this
    run's fp8 / serve choices); `counts_match`: this run's totals are its own plan's counts."""

    plan = Settings.for_device("cuda", settings.work)
    plan.fp8, plan.serve = settings.fp8, settings.serve

    counts = plan_counts(plan)
    runs = shape_runs(plan)
    shapes, largest = plan.shapes, plan.shapes[-1]
    engines = [run.shape for run in runs] + ([largest] if plan.fp8 else [])
    layers = sum(s.num_hidden_layers for s in engines)
    terms = {
        "triton compiles": UNIT_S["triton_compile"] * counts["kernel_variants"],
        "graph captures": UNIT_S["graph_capture_per_layer"] * layers
        * counts["graph_captures"] / len(engines),
        "engine builds": sum(UNIT_S["engine_build"] + UNIT_S["engine_build_per_gb"] * _gb(s)
                             for s in engines),
        "fp8 calibration and gate (host)": (UNIT_S["fp8_host_gate_per_gb"] * _gb(largest)
                                            if plan.fp8 else 0.0),
        "engine loads": sum(UNIT_S["engine_load"] + UNIT_S["engine_load_per_gb"] * _gb(s)
                            for s in engines),
    }
    reference_steps = (parity.PARITY_PROMPTS * parity.PARITY_TOKENS
                       + len(plan.concurrencies) * (plan.new_tokens + 2))
    parity_steps = parity.PARITY_PROMPTS * parity.PARITY_TOKENS
    terms["reference runs"] = sum((reference_steps if run.measure_speed else parity_steps)
                                  * UNIT_S["reference_step_per_layer"] * run.shape.num_hidden_layers
                                  for run in runs)
    # Our tokens at the targets (the smaller shape at the same rates: it is no slower).
    ours = sum(c * (plan.new_tokens + 4) / GPU_TARGETS[c] for c in plan.concurrencies)
    c = max(plan.concurrencies)
    terms["measured tokens"] = (len(shapes) * ours
                                + (c * plan.new_tokens / GPU_TARGETS[c] if plan.fp8 else 0.0))
    if plan.serve:
        terms["served"] = UNIT_S["served_start"] + 5 * c * plan.new_tokens / (0.8 * GPU_TARGETS[c])
    total = sum(terms.values())
    here = plan_counts(settings)
    measured = {k: totals.get(k, 0) for k in here}
    return {"seconds": round(total, 1), "terms": {k: round(v, 1) for k, v in terms.items()},
            "fits_5_minutes": total <= 300, "unit_seconds": UNIT_S,
            "gpu_plan": {"shapes": [s.name for s in shapes], "concurrencies": plan.concurrencies,
                         "capture_sizes": capture_sizes(plan), **counts},
            "this_run": {"planned": here, "measured": measured, "counts_match": here == measured}}

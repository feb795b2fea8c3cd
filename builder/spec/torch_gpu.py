"""The torch target on a GPU, at build time: what a spec may ask of it, the KV-cache fraction and
limits its engine records, and where the build runs its checks.

A GPU engine is prepared anywhere, a CPU machine or CI included: converting the weights needs no
GPU, and the checks (prefill logits against transformers, the quality gate of a quantized build)
run on the GPU where one is visible, else on the CPU. What only the GPU can tell (its free
memory, FP8 on `hardware: cuda`) is decided where the engine runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from builder.spec.hardware import FP8_PROFILES, PROFILES, TORCH_GPU_PROFILES, memory_plan, sized_limits
from triton_backend.engine.config import Limits, ModelShape

if TYPE_CHECKING:
    from builder.spec.build_spec import BuildSpec

FRACTION_KEYS = ("kv_cache.free_gpu_mem_fraction", "repository.kv_cache_free_gpu_mem_fraction")


def is_gpu_engine(hardware: str) -> bool:
    return hardware in PROFILES and PROFILES[hardware].is_gpu


def check_gpu_spec(spec: "BuildSpec") -> None:
    """What a torch (or naive) spec with a GPU `hardware` may not ask; ValueError naming the field."""
    profile = PROFILES[spec.hardware]
    if spec.target != "torch":
        raise ValueError(f"hardware: target {spec.target} runs on the CPU (hardware: cpu); "
                         f"{spec.hardware!r} is for targets torch and trtllm")
    if spec.parallelism.world_size != 1 or spec.parallelism.moe_set:
        raise ValueError("parallelism: tp/pp are TensorRT-LLM's (target trtllm); target torch "
                         "runs on one GPU (tp: 1, pp: 1)")
    if spec.quantization.lm_head != "none":
        raise ValueError(f"quantization.lm_head: {spec.quantization.lm_head!r} runs on the CPU "
                         f"kernels; a GPU engine (hardware {spec.hardware}) uses none")
    if spec.quantization.weights == "fp8" and not profile.may_run_fp8:
        raise ValueError(f"quantization.weights: fp8 needs FP8 tensor cores (SM >= 89: "
                         f"{', '.join(FP8_PROFILES)}, or cuda where the GPU decides); "
                         f"{spec.hardware} is SM {profile.sm}")
    kv_free_fraction(spec)


def check_cpu_spec(spec: "BuildSpec") -> None:
    """What a spec for `hardware: cpu` may not ask; ValueError naming the field."""
    if spec.dtype == "float16":
        raise ValueError(f"dtype: float16 is for GPU engines (hardware "
                         f"{', '.join(TORCH_GPU_PROFILES)}); a CPU engine computes in bfloat16 "
                         f"or float32")
    given = _given_fractions(spec)
    if given:
        key, value = next(iter(given.items()))
        raise ValueError(f"{key}: {value} sizes the KV cache from a GPU's free memory; hardware "
                         f"cpu sizes it by kv_cache.num_blocks or kv_cache.memory_bytes")


def _given_fractions(spec: "BuildSpec") -> dict[str, float]:
    values = (spec.kv_cache.free_gpu_mem_fraction,
              (spec.repository or {}).get("kv_cache_free_gpu_mem_fraction"))
    return {key: value for key, value in zip(FRACTION_KEYS, values) if value is not None}


def kv_free_fraction(spec: "BuildSpec") -> float | None:
    """The GPU engine's `kv_cache.free_gpu_mem_fraction`: the spec's (under either key, the same
    one TensorRT-LLM's repository uses or the engine's own), else the profile's; None where the
    spec sizes the pool itself (kv_cache.num_blocks / memory_bytes), which then wins."""
    given = _given_fractions(spec)
    if len(set(given.values())) > 1:
        raise ValueError(f"{FRACTION_KEYS[0]} ({given[FRACTION_KEYS[0]]}) and {FRACTION_KEYS[1]} "
                         f"({given[FRACTION_KEYS[1]]}) differ; give one")
    if spec.kv_cache.num_blocks is not None or spec.kv_cache.memory_bytes is not None:
        if given:
            raise ValueError(f"{next(iter(given))}: the KV pool is sized by kv_cache.num_blocks / "
                             f"kv_cache.memory_bytes in this spec; give those or a fraction of "
                             f"the free GPU memory, not both")
        return None
    return next(iter(given.values()), PROFILES[spec.hardware].kv_cache_free_gpu_mem_fraction)


def gpu_limits(spec: "BuildSpec", shape: ModelShape, fallback: Limits) -> tuple[Limits, dict]:
    """(limits, the memory plan as recorded in config.json's `extra.gpu`) for a GPU engine.

    On a profile of known memory, limits the spec does not give are sized from it as for
    TensorRT-LLM (builder/spec/hardware.py), for the torch runtime's KV layout (keys and values in the
    engine's dtype, or one byte each when quantized), and given ones must fit; on `cuda` the
    memory is unknown, so the spec's or `fallback` stand, and the runtime sizes the pool.
    """
    profile = PROFILES[spec.hardware]
    record: dict = {"hardware": profile.name, "sm": profile.sm}
    if not profile.sized:
        return spec.limits or fallback, record
    element = 4 if spec.dtype == "float32" else 2
    plan = memory_plan(shape, profile, spec.quantization.weights, spec.quantization.kv_cache,
                       kv_cache_free_gpu_mem_fraction=kv_free_fraction(spec),
                       element_bytes=element)
    limits = sized_limits(shape, profile, plan, spec.kv_cache.tokens_per_block, spec.limits,
                          split=False)
    record["memory"] = {"weights_bytes": plan.weights_bytes,
                        "kv_budget_bytes": plan.kv_budget_bytes, "kv_tokens": plan.kv_tokens}
    return limits, record


def build_check_device(hardware: str) -> str:
    """Where a build runs its engine checks: a GPU engine on the GPU where one is visible, else
    (a CPU machine preparing a GPU deployment) on the CPU; a CPU engine on the CPU."""
    if not is_gpu_engine(hardware):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_unavailable(engine_dir: str | Path, hardware: str) -> str | None:
    """None where the GPU engine in `engine_dir` can run here (a CPU engine always can); else
    the one line saying why not: the engine, its hardware and that no CUDA device is visible."""
    if not is_gpu_engine(hardware):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (f"engine {engine_dir} (hardware {hardware}) runs on a CUDA GPU and no CUDA device is "
            f"visible here (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'not built in'})")

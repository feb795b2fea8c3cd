"""Pick the executor for an engine by its `config.target`; all offer the same verbs.

`torch` -> the project's runtime; `naive` -> the reference executor (transformers, one request at
a time). `trtllm` engines are built by llm-forge and served by NVIDIA's C++ `tensorrtllm` backend;
an executor over `tensorrt_llm.bindings.executor` with these verbs is not written yet (the
repository refuses `tensorrt_llm_backend: python` for them), so an engine directory of that
target that reaches this point is refused by name rather than half-served.

`engine_isolation` says where the engine loop runs: `process` (the default for serving) starts an
engine process whose main thread runs it, so torch computes at full speed and the Triton stub
only moves messages; `thread` runs it on a thread of the calling process (for debugging).
"""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.admission import AdmissionLimits
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.cpu_budget import available_cores
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.process.executor import ENGINE_ISOLATIONS
from triton_backend.engine.process.watchdog import DEFAULT_FREEZE_SECONDS
from triton_backend.engine.scheduler import DEFAULT_AGING_RATE
from triton_backend.models.model_params import ModelParams


def engine_options(params: ModelParams, device: str | None = None) -> EngineOptions:
    """The `tensorrt_llm` model's parameters as the one options value its executor is built
    with: KV cache size, the repository's off switches (true: as the engine's config.json says),
    admission limits and priority aging (the build spec's `serving:` section; absent ones, in an
    older repository, mean unbounded and the default). `device`: where the model instance runs
    the engine (None: the engine's own kind of device)."""
    def off_or_none(key: str) -> bool | None:
        return None if params.flag(key, True) else False

    return EngineOptions(
        kv_cache_num_blocks=params.integer("kv_cache_num_blocks"),
        kv_cache_memory_bytes=params.integer("kv_cache_memory_bytes"),
        enable_prefix_caching=off_or_none("enable_kv_cache_reuse"),
        enable_speculative_decoding=off_or_none("enable_speculative_decoding"),
        admission=AdmissionLimits(params.integer("max_waiting_requests", 0),
                                  params.integer("max_waiting_prompt_tokens", 0)),
        priority_aging_rate=params.number("priority_aging_rate", DEFAULT_AGING_RATE),
        device=device,
        kv_cache_free_gpu_mem_fraction=params.number("kv_cache_free_gpu_mem_fraction", None),
        enable_cuda_graphs=off_or_none("cuda_graph_mode"))


def create_executor(engine_dir: Path, options: EngineOptions = EngineOptions(), *,
                    isolation: str = "process", num_threads: int = 0,
                    freeze_seconds: float | None = DEFAULT_FREEZE_SECONDS):
    """The executor of `engine_dir`'s target, built with `options` (see `EngineOptions`: the
    naive baseline serves one request at a time in arrival order and applies neither admission
    nor aging, nor deadlines). `freeze_seconds`: the engine process's watchdog limit (see
    `process/watchdog.py`; a loop in a thread of this process has no watchdog)."""
    if isolation not in ENGINE_ISOLATIONS:
        raise ValueError(f"engine_isolation must be one of {ENGINE_ISOLATIONS}, got {isolation!r}")
    config = EngineConfig.load(engine_dir)
    if config.target not in ("torch", "naive"):
        raise ValueError(f"{engine_dir}: target {config.target!r} has no executor")
    if isolation == "process":
        from triton_backend.engine.process.executor import ProcessExecutor

        return ProcessExecutor(engine_dir, options, num_threads=num_threads,
                               freeze_seconds=freeze_seconds)
    import torch

    torch.set_num_threads(num_threads or available_cores())
    if config.target == "naive":
        from triton_backend.naive.executor import NaiveExecutor

        return NaiveExecutor(engine_dir)
    from triton_backend.engine.executor import Executor

    return Executor(engine_dir, **options.executor_kwargs())

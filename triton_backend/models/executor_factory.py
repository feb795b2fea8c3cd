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
from triton_backend.engine.process.executor import ENGINE_ISOLATIONS, available_cores
from triton_backend.engine.scheduler import DEFAULT_AGING_RATE


def create_executor(engine_dir: Path, num_kv_blocks: int | None = None,
                    kv_cache_memory_bytes: int | None = None, *, isolation: str = "process",
                    num_threads: int = 0, enable_prefix_caching: bool | None = None,
                    enable_speculative_decoding: bool | None = None,
                    admission: AdmissionLimits = AdmissionLimits(),
                    priority_aging_rate: float = DEFAULT_AGING_RATE):
    """`enable_*`: None follows the engine's config.json, False turns the feature off.
    `admission` and `priority_aging_rate` apply to the torch runtime; the naive baseline serves
    one request at a time in arrival order and applies neither (nor deadlines)."""
    if isolation not in ENGINE_ISOLATIONS:
        raise ValueError(f"engine_isolation must be one of {ENGINE_ISOLATIONS}, got {isolation!r}")
    config = EngineConfig.load(engine_dir)
    if config.target not in ("torch", "naive"):
        raise ValueError(f"{engine_dir}: target {config.target!r} has no executor")
    if isolation == "process":
        from triton_backend.engine.process.executor import ProcessExecutor

        return ProcessExecutor(engine_dir, num_kv_blocks=num_kv_blocks,
                               kv_cache_memory_bytes=kv_cache_memory_bytes,
                               num_threads=num_threads, enable_prefix_caching=enable_prefix_caching,
                               enable_speculative_decoding=enable_speculative_decoding,
                               admission=admission, priority_aging_rate=priority_aging_rate)
    import torch

    torch.set_num_threads(num_threads or available_cores())
    if config.target == "naive":
        from triton_backend.naive.executor import NaiveExecutor

        return NaiveExecutor(engine_dir)
    from triton_backend.engine.executor import Executor

    return Executor(engine_dir, num_kv_blocks=num_kv_blocks,
                    kv_cache_memory_bytes=kv_cache_memory_bytes,
                    enable_prefix_caching=enable_prefix_caching,
                    enable_speculative_decoding=enable_speculative_decoding,
                    admission=admission, priority_aging_rate=priority_aging_rate)

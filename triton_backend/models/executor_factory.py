"""Pick the executor for an engine by its `config.target`; all offer the same verbs.

`torch` -> the project's runtime; `naive` -> the reference executor; `trtllm` -> an adapter over
TensorRT-LLM's executor bindings (GPU hosts only; imported only when asked for).
"""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.config import EngineConfig


def create_executor(engine_dir: Path, num_kv_blocks: int | None = None,
                    kv_cache_memory_bytes: int | None = None):
    config = EngineConfig.load(engine_dir)
    if config.target == "torch":
        from triton_backend.engine.executor import Executor

        return Executor(engine_dir, num_kv_blocks=num_kv_blocks,
                        kv_cache_memory_bytes=kv_cache_memory_bytes)
    if config.target == "naive":
        from triton_backend.naive.executor import NaiveExecutor

        return NaiveExecutor(engine_dir)
    if config.target == "trtllm":
        from triton_backend.models.trtllm_executor import TrtllmExecutor

        return TrtllmExecutor(engine_dir, kv_cache_memory_bytes=kv_cache_memory_bytes)
    raise ValueError(f"{engine_dir}: target {config.target!r} has no executor")

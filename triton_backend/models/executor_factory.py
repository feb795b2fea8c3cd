"""Pick the executor for an engine by its `config.target`; all offer the same verbs.

`torch` -> the project's runtime; `naive` -> the reference executor (transformers, one request at
a time). `trtllm` engines are not built by llm-forge yet, so none can reach this point; an engine
directory that claims the target is refused by name rather than half-served.
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
    raise ValueError(f"{engine_dir}: target {config.target!r} has no executor")

"""`EngineOptions`: what an executor is built with beyond its engine directory, as one value.

The same options cross the process boundary (`ProcessExecutor` -> the engine process), so they
travel as one JSON text written by `to_json` and read back by `from_json`: an option added here
reaches the engine process without further plumbing, instead of silently taking its default
there. Pure Python.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from triton_backend.engine.admission import AdmissionLimits
from triton_backend.engine.scheduler import DEFAULT_AGING_RATE


@dataclass(frozen=True)
class EngineOptions:
    """`enable_*`: None follows the engine's config.json, False turns the feature off.
    `admission` and `priority_aging_rate` apply to the torch runtime (the naive baseline serves
    one request at a time in arrival order). `device`: None follows the engine's hardware (cpu,
    or the current CUDA device for a GPU engine), else `cpu`, `cuda` or `cuda:N`.
    `kv_cache_free_gpu_mem_fraction`: on a GPU, the share of the memory left free after loading
    that the KV cache takes (None: the engine's config.json, else its block count).
    `enable_cuda_graphs`: False runs the GPU backend's decode steps eagerly (None: captured)."""

    kv_cache_num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool | None = None
    enable_speculative_decoding: bool | None = None
    admission: AdmissionLimits = AdmissionLimits()
    priority_aging_rate: float = DEFAULT_AGING_RATE
    device: str | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    enable_cuda_graphs: bool | None = None

    def executor_kwargs(self) -> dict:
        """The options as `Executor` keyword arguments (one per field, nested values kept)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineOptions":
        values = json.loads(text)
        values["admission"] = AdmissionLimits(**values["admission"])
        return cls(**values)

"""The llm-forge runtime: paged KV cache, in-flight batching scheduler, model runner, executor.

Nothing in this package imports Triton; the Triton models in `triton_backend.models` adapt it.
"""
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "FinishReason", "Request", "Response", "SamplingParams"]

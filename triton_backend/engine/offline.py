"""Offline use of the engine: generate for a list of prompts, or read prefill logits.

Used by `forge generate`, the build-time check and the tests; it drives `LLMEngine` step by step
in the calling thread (the `Executor` does the same from a background thread).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.request import FinishReason, Request


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: FinishReason
    log_probs: list[float]


def generate(engine: LLMEngine, requests: list[Request]) -> list[GenerationResult]:
    """Run `requests` together (in-flight batched) to completion; results in request order."""
    ids = [engine.add_request(r) for r in requests]
    results = {i: GenerationResult([], FinishReason.LENGTH, []) for i in ids}
    while engine.has_work():
        for response in engine.step():  # streamed requests arrive in pieces: concatenate
            result = results[response.request_id]
            result.output_ids.extend(response.output_token_ids)
            result.log_probs.extend(response.log_probs)
            if response.is_final:
                result.finish_reason = response.finish_reason
    return [results[i] for i in ids]


def prefill_logits(engine_dir: str | Path, token_ids: list[int],
                   device: str | None = None) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of one prefill over `token_ids` (no sampling effects), on
    `device` (None: the engine's own)."""
    tokens_per_block = EngineConfig.load(engine_dir).kv_cache.tokens_per_block
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=len(token_ids) // tokens_per_block + 2,
                       enable_prefix_caching=False, enable_speculative_decoding=False,
                       device=device, enable_cuda_graphs=False)
    engine.add_request(Request(input_token_ids=list(token_ids), max_tokens=1))
    chunks = []  # a prompt longer than max_num_tokens is prefilled in several steps
    while engine.has_work():
        engine.step(return_logits=True)
        chunks.append(engine.last_logits)
    return torch.cat(chunks)

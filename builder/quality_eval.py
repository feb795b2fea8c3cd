"""The two sides the quality gate compares: the unquantized source (transformers, float32) and the
built engine (the torch runtime, through `LLMEngine`, so its kernels and its KV cache are the ones
measured). Both answer the same two questions: prefill logits of a token window, and a greedy
continuation of a prompt.
"""
from __future__ import annotations

from pathlib import Path

import torch

from triton_backend.engine.config import EngineConfig


class ReferenceModel:
    """The unquantized HF checkpoint in float32 (full recompute; no cache to quantize)."""

    def __init__(self, hf_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        ids = list(token_ids)
        for _ in range(num_tokens):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(token_ids):]


class EngineModel:
    """A built engine run by the torch runtime, one request at a time."""

    def __init__(self, engine_dir: str | Path, max_tokens: int) -> None:
        from triton_backend.engine.llm_engine import LLMEngine

        config = EngineConfig.load(engine_dir)
        blocks = -(-max_tokens // config.kv_cache.tokens_per_block) + 2
        self.engine = LLMEngine(engine_dir, num_kv_blocks=blocks)
        self.max_input_len = config.limits.max_input_len

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        from triton_backend.engine.request import Request

        self.engine.add_request(Request(input_token_ids=list(token_ids), max_tokens=1))
        chunks = []  # a window longer than max_num_tokens is prefilled in several steps
        while self.engine.has_work():
            self.engine.step(return_logits=True)
            chunks.append(self.engine.last_logits)
        return torch.cat(chunks).float()

    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        from triton_backend.engine.offline import generate
        from triton_backend.engine.request import Request

        request = Request(input_token_ids=list(token_ids), max_tokens=num_tokens, ignore_eos=True)
        return generate(self.engine, [request])[0].output_ids

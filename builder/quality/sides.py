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
    """The unquantized HF checkpoint in float32. Answers are memoized, so one instance can serve
    several engines (the benchmark compares every variant against the same reference)."""

    def __init__(self, hf_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.hf_dir = Path(hf_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        key = tuple(token_ids)
        if key not in self._logits:
            self._logits[key] = self.model(torch.tensor([token_ids])).logits[0].float()
        return self._logits[key]

    @torch.inference_mode()
    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        key = (tuple(token_ids), num_tokens)
        if key not in self._greedy:
            # A plain loop: `generate(min_new_tokens=...)` would mask EOS, which the engine (with
            # ignore_eos) may still pick.
            out = self.model(torch.tensor([token_ids]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(num_tokens - 1):
                out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                                 use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            self._greedy[key] = tokens
        return self._greedy[key]


class EngineModel:
    """A built engine run by the torch runtime, one request at a time."""

    def __init__(self, engine_dir: str | Path, max_tokens: int) -> None:
        from builder.spec.torch_gpu import build_check_device
        from triton_backend.engine.llm_engine import LLMEngine

        config = EngineConfig.load(engine_dir)
        blocks = -(-max_tokens // config.kv_cache.tokens_per_block) + 2
        # Every window's logits are read, so none may come from the prefix cache. A GPU engine
        # prepared on a machine without one is measured on the CPU.
        self.engine = LLMEngine(engine_dir, kv_cache_num_blocks=blocks, enable_prefix_caching=False,
                                device=build_check_device(config.hardware))
        self.max_input_len = config.limits.max_input_len

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        from triton_backend.engine.request import Request

        self.engine.add_request(Request(input_token_ids=list(token_ids), max_tokens=1))
        chunks = []  # a window longer than max_num_tokens is prefilled in several steps
        while self.engine.has_work():
            self.engine.step(return_logits=True)
            chunks.append(self.engine.last_logits)
        return torch.cat(chunks).float().cpu()  # beside the reference, on the CPU

    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        from triton_backend.engine.offline import generate
        from triton_backend.engine.request import Request

        request = Request(input_token_ids=list(token_ids), max_tokens=num_tokens, ignore_eos=True)
        return generate(self.engine, [request])[0].output_ids

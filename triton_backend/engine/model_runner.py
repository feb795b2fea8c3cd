"""Runs one scheduled step: pack every scheduled token into one flat tensor, attend over the paged
KV cache, project only the rows that sample, and sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from triton_backend.engine.attention import AttentionMetadata, PrefillChunk
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.sampler import Sampler
from triton_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from triton_backend.engine.weights import load_model, runtime_dtype


@dataclass
class RunnerOutput:
    sampled: dict[int, tuple[int, float]]  # seq_id -> (token id, log prob)
    logits: torch.Tensor | None = None      # [T, V] for every packed token, when asked for


def make_kv_cache(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                  num_blocks: int) -> PagedKVCache:
    if config.kv_cache.dtype != "auto":
        from triton_backend.engine.quant import make_quantized_kv_cache  # optional runtime half

        return make_quantized_kv_cache(config, num_blocks, device)
    return PagedKVCache(config.model, num_blocks, config.kv_cache.tokens_per_block, dtype, device)


def kv_bytes_per_token(config: EngineConfig, dtype: torch.dtype) -> int:
    if config.kv_cache.dtype != "auto":
        from triton_backend.engine.quant import quantized_kv_bytes_per_token

        return quantized_kv_bytes_per_token(config)
    return PagedKVCache.bytes_per_token(config.model, dtype)


class ModelRunner:
    def __init__(self, engine_dir: str | Path, config: EngineConfig, num_blocks: int,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = runtime_dtype(config, self.device)
        self.tokens_per_block = config.kv_cache.tokens_per_block
        self.model = load_model(engine_dir, config, self.device)
        self.kv_cache = make_kv_cache(config, self.dtype, self.device, num_blocks)
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, eos_ids: dict[int, frozenset[int]],
            return_logits: bool = False) -> RunnerOutput:
        input_ids, positions, meta, sample_rows = self._prepare(output.chunks)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        all_logits = self.model.logits(hidden) if return_logits else None
        sampling_chunks = [c for c in output.chunks if c.needs_sample]
        if not sampling_chunks:
            return RunnerOutput({}, all_logits)
        rows = torch.tensor(sample_rows, device=self.device)
        logits = all_logits[rows] if all_logits is not None else self.model.logits(hidden[rows])
        picks = self.sampler(logits.cpu(), sampling_chunks, eos_ids)
        return RunnerOutput({c.seq_id: p for c, p in zip(sampling_chunks, picks)}, all_logits)

    def _prepare(self, chunks: list[ScheduledChunk]):
        ids, positions, new_slots, sample_rows = [], [], [], []
        prefills, decodes = [], []
        for chunk in chunks:
            start, q_len = chunk.num_computed_tokens, len(chunk.new_token_ids)
            q_start = len(ids)
            ids.extend(chunk.new_token_ids)
            positions.extend(range(start, start + q_len))
            new_slots.append(self._slots(chunk.block_table, start, start + q_len))
            if q_len == 1 and start > 0:
                decodes.append((q_start, chunk))
            else:
                cached = self._slots(chunk.block_table, 0, start + q_len) if start > 0 else None
                prefills.append(PrefillChunk(q_start, q_start + q_len, start, cached))
            if chunk.needs_sample:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(slot_mapping=torch.cat(new_slots).to(self.device),
                                 prefills=prefills)
        if decodes:
            self._add_decodes(meta, decodes)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), meta, sample_rows

    def _slots(self, block_table: list[int], begin: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [begin, end) of a sequence with `block_table`."""
        positions = torch.arange(begin, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.tokens_per_block]
        return (blocks * self.tokens_per_block + positions % self.tokens_per_block).to(self.device)

    def _add_decodes(self, meta: AttentionMetadata, decodes: list[tuple[int, ScheduledChunk]]) -> None:
        """Padded key slots [n, max_k] and a mask of the real keys for all decodes at once."""
        tpb = self.tokens_per_block
        key_lens = torch.tensor([c.num_computed_tokens + 1 for _, c in decodes])
        max_k = int(key_lens.max())
        max_blocks = -(-max_k // tpb)
        tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, (_, chunk) in enumerate(decodes):
            table = chunk.block_table[:max_blocks]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
        positions = torch.arange(max_k)
        slots = tables[:, positions // tpb] * tpb + positions % tpb
        mask = (positions.unsqueeze(0) < key_lens.unsqueeze(1))[:, None, None, :]
        meta.decode_token_index = torch.tensor([q for q, _ in decodes], device=self.device)
        meta.decode_key_slots = slots.to(self.device)
        meta.decode_key_mask = mask.to(self.device)

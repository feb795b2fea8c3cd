"""A step's inputs as a backend's kernels read them: the scheduled chunks packed into one flat
row tensor (in the order the backend attends them), their positions and cache slots, and the
attention metadata (attention.py) for the route each chunk takes.

Which route a chunk takes is its backend's answer (`attends_in_place`, `prefills_in_place`, and
whether its kernels read the cache in place at all): the paged kernel in place (packed first,
`kernel_rows`), the prefill kernel in place (packed after, `PrefillRun`s), or the torch path
(`PrefillChunk`s, the torch decodes). Each backend owns one of these (`ops.TorchOps.prepare`).
"""
from __future__ import annotations

from itertools import groupby

import torch

from triton_backend.engine.attention import AttentionMetadata, PrefillChunk, PrefillRun
from triton_backend.engine.device import host_to_device
from triton_backend.engine.scheduler import ScheduledChunk

PAGED, PREFILL, TORCH = "paged", "prefill", "torch"


class StepInputs:
    def __init__(self, ops, tokens_per_block: int, device: torch.device,
                 kernel_attention: bool, one_byte_cache: bool) -> None:
        """`kernel_attention`: the backend's kernels read this cache in place (else every chunk
        takes the torch path); `one_byte_cache`: an int8 or FP8 cache."""
        self.ops = ops
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.kernel_attention = kernel_attention
        self.one_byte_cache = one_byte_cache

    def route(self, chunk: ScheduledChunk) -> str:
        """PAGED, PREFILL or TORCH, as the backend attends a chunk of this shape."""
        if not self.kernel_attention:
            return TORCH
        shape = (len(chunk.new_token_ids), chunk.num_computed_tokens, self.one_byte_cache)
        if self.ops.attends_in_place(*shape):
            return PAGED
        return PREFILL if self.ops.prefills_in_place(*shape) else TORCH

    def _keys_as_computed(self, chunk: ScheduledChunk) -> bool:
        """A prompt's first chunk over a one-byte cache attends its keys as computed, not as
        stored (as the torch path does, and TensorRT-LLM's context phase)."""
        return self.one_byte_cache and chunk.num_computed_tokens == 0

    def packing_order(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The paged kernel's chunks first, then the prefill kernel's (those reading their keys as
        computed first, so each source is one run of rows); within each group, the chunks of one
        adapter side by side, so each adapter's rows are one run."""
        if any(c.lora_task_id is not None for c in chunks):
            chunks = sorted(chunks, key=lambda c: -1 if c.lora_task_id is None else c.lora_task_id)
        if not self.kernel_attention:
            return chunks

        def group(chunk: ScheduledChunk) -> int:
            route = self.route(chunk)
            if route == PREFILL:
                return 1 if self._keys_as_computed(chunk) else 2
            return 0 if route == PAGED else 3

        return sorted(chunks, key=group)  # stable: adapters stay side by side

    def prepare(self, chunks: list[ScheduledChunk]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(token ids, positions, attention metadata, the rows that sample) of a step whose
        chunks are in packing order."""
        tpb = self.tokens_per_block
        ids, positions, slots, sample_rows = [], [], [], []
        prefills, decodes, kernel_chunks, prefill_chunks = [], [], [], []
        for chunk in chunks:
            start, q_len = chunk.num_computed_tokens, len(chunk.new_token_ids)
            q_start = len(ids)
            table = chunk.block_table
            ids.extend(chunk.new_token_ids)
            positions.extend(range(start, start + q_len))
            slots.extend(table[p // tpb] * tpb + p % tpb for p in range(start, start + q_len))
            route = self.route(chunk)
            if route == PAGED:
                kernel_chunks.append(chunk)
            elif route == PREFILL:
                prefill_chunks.append((q_start, chunk))
            elif q_len == 1 and start > 0:
                decodes.append((q_start, chunk))
            else:
                cached = None
                if start > 0:
                    cached = torch.tensor([table[p // tpb] * tpb + p % tpb
                                           for p in range(start + q_len)], device=self.device)
                prefills.append(PrefillChunk(q_start, q_start + q_len, start, cached))
            if chunk.needs_sample:  # the last row, and one more per draft token before it
                sample_rows.extend(range(len(ids) - 1 - chunk.num_draft_tokens, len(ids)))
        meta = AttentionMetadata(slot_mapping=self._long(slots), prefills=prefills)
        if decodes:
            self._add_decodes(meta, decodes)
        if kernel_chunks:
            self._add_kernel_chunks(meta, kernel_chunks)
        for as_computed, run in groupby(prefill_chunks, key=lambda c: self._keys_as_computed(c[1])):
            meta.prefill_runs.append(self._prefill_run(list(run), as_computed))
        return self._long(ids), self._long(positions), meta, sample_rows

    def _long(self, values: list[int]) -> torch.Tensor:
        return host_to_device(values, torch.long, self.device)

    def _add_kernel_chunks(self, meta: AttentionMetadata, chunks: list[ScheduledChunk]) -> None:
        """Block tables (0-padded), key counts and row offsets of the packed-first chunks."""
        width = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        seq_lens = [c.num_computed_tokens + len(c.new_token_ids) for c in chunks]
        query_start = [0]
        for chunk in chunks:
            query_start.append(query_start[-1] + len(chunk.new_token_ids))
        as_int = lambda xs: host_to_device(xs, torch.int32, self.device)  # noqa: E731
        meta.kernel_rows = query_start[-1]
        meta.block_tables, meta.seq_lens = as_int(tables), as_int(seq_lens)
        meta.query_start = as_int(query_start)
        meta.max_query_len = max(len(c.new_token_ids) for c in chunks)
        meta.max_seq_len = max(seq_lens)

    def _prefill_run(self, chunks: list[tuple[int, ScheduledChunk]], as_computed: bool
                     ) -> PrefillRun:
        """One run of the prefill kernel's chunks (packed side by side from their first row):
        block tables of the cache, or, for keys as computed, each chunk's own rows in the run
        (blocks of one row)."""
        begin = chunks[0][0]
        query_start, tables, seq_lens = [0], [], []
        for q_start, chunk in chunks:
            q_len = len(chunk.new_token_ids)
            query_start.append(q_start + q_len - begin)
            if as_computed:
                tables.append(list(range(q_start - begin, q_start - begin + q_len)))
                seq_lens.append(q_len)
            else:
                tables.append(chunk.block_table)
                seq_lens.append(chunk.num_computed_tokens + q_len)
        width = max(len(t) for t in tables)
        as_int = lambda xs: host_to_device(xs, torch.int32, self.device)  # noqa: E731
        return PrefillRun(begin, begin + query_start[-1],
                          as_int([t + [0] * (width - len(t)) for t in tables]),
                          as_int(seq_lens), as_int(query_start),
                          1 if as_computed else self.tokens_per_block, as_computed,
                          max(seq_lens))

    def _add_decodes(self, meta: AttentionMetadata, decodes: list[tuple[int, ScheduledChunk]]) -> None:
        """Padded key slots [n, max_k] and a mask of the real keys for all decodes at once."""
        tpb = self.tokens_per_block
        key_lens = torch.tensor([c.num_computed_tokens + 1 for _, c in decodes], device="cpu")
        max_k = int(key_lens.max())
        max_blocks = -(-max_k // tpb)
        tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long, device="cpu")
        for i, (_, chunk) in enumerate(decodes):
            table = chunk.block_table[:max_blocks]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long, device="cpu")
        positions = torch.arange(max_k, device="cpu")
        slots = tables[:, positions // tpb] * tpb + positions % tpb
        mask = (positions.unsqueeze(0) < key_lens.unsqueeze(1))[:, None, None, :]
        meta.decode_token_index = torch.tensor([q for q, _ in decodes], device=self.device)
        meta.decode_key_slots = slots.to(self.device)
        meta.decode_key_mask = mask.to(self.device)

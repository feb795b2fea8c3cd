"""The GPU backend's start-up warm-up: every Triton kernel variant an engine can meet, launched
once before the first request, so that no request waits for a compile.

The variants (`variants.py`): the fused ops of this model's shapes (norm with and without the
residual, SiLU * up, rotary with the cache write in the cache's format) and the paged kernel at
each split count a decode can take (`paged_attention.split_buckets`) and each query tile a chunk over a
cached prefix can take (`query_buckets`); over a one-byte cache, also each query tile of a first
chunk's run over its own keys. Each is one forward of padded tokens: they attend nothing
(`seq_lens` 0) and write their keys to the slot no sequence owns (`pad_slot`), as a captured
graph's padded rows do. Work done inside the `warm_up` block (capturing the decode
graphs) counts as start-up too; after it, a new variant is a compile while serving.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from triton_backend.engine.attention import AttentionMetadata, PrefillRun
from triton_backend.engine.gpu.paged_attention import (MIN_KEYS_PER_SPLIT, launch_constants,
                                                       split_buckets)
from triton_backend.engine.gpu.variants import VARIANTS


def query_buckets(num_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int
                  ) -> list[int]:
    """A `max_query_len` for each query tile a chunk longer than one row can take (the tile
    stops growing at 64 rows of heads)."""
    lengths, length = [], 2
    while True:
        constants = launch_constants(torch.float32, False, num_heads, num_kv_heads, head_dim,
                                     tokens_per_block, length, 1)
        lengths.append(length)
        if constants["BLOCK_Q"] < length:
            return lengths[:-1] or [2]
        length *= 2


def planned_variants(model, kv_cache, num_sms: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(max_query_len, the step's max_seq_len) of each paged-kernel variant to warm."""
    shape = model.config.model
    splits = split_buckets(shape.num_key_value_heads, max_seq_len, num_sms)
    decodes = [(1, split * MIN_KEYS_PER_SPLIT) for split in splits]
    chunks = [(length, max_seq_len) for length in
              query_buckets(shape.num_attention_heads, shape.num_key_value_heads,
                            shape.head_dim, kv_cache.tokens_per_block)]
    return decodes + chunks


def _warm_steps(model, kv_cache, num_sms: int, max_seq_len: int, pad_slot: int,
                device: torch.device) -> list[tuple[int, AttentionMetadata]]:
    """(tokens, metadata) of each warm-up forward: padded rows that attend nothing (seq_lens 0)
    and write the slot no sequence owns."""

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    def slots(n):
        return torch.full((n,), pad_slot, dtype=torch.long, device=device)

    steps = [(1, AttentionMetadata(slot_mapping=slots(1), kernel_rows=1,
                                   block_tables=ints([[0]]), seq_lens=ints([0]),
                                   query_start=ints([0, 1]), max_query_len=max_query_len,
                                   max_seq_len=step_max_seq_len))
             for max_query_len, step_max_seq_len in planned_variants(model, kv_cache, num_sms,
                                                                     max_seq_len)]
    if kv_cache.k.element_size() == 1:  # first chunks attend their keys as computed: a run of
        shape = model.config.model     # R rows over one-token blocks, each query tile
        for rows in [1, *query_buckets(shape.num_attention_heads, shape.num_key_value_heads,
                                       shape.head_dim, 1)]:
            run = PrefillRun(0, rows, ints([list(range(rows))]), ints([0]), ints([0, rows]), 1,
                             keys_as_computed=True, max_seq_len=rows)
            steps.append((rows, AttentionMetadata(slot_mapping=slots(rows), prefill_runs=[run])))
    return steps


@contextmanager
def warm_up(model, kv_cache, ops, pad_slot: int, max_seq_len: int) -> Iterator[None]:
    """Launch every variant, then run the block (graph capture) as start-up; on leaving, mark
    the process warm."""
    device = kv_cache.k.device
    with VARIANTS.warming(), torch.inference_mode():
        for tokens, meta in _warm_steps(model, kv_cache, ops.num_sms, max_seq_len, pad_slot,
                                        device):
            zeros = torch.zeros(tokens, dtype=torch.long, device=device)
            model(zeros, zeros, kv_cache, meta, ops)
        yield
    VARIANTS.mark_warm()


def planned_variant_names(hidden_size: int, intermediate_size: int, num_heads: int,
                          num_kv_heads: int, head_dim: int, tokens_per_block: int,
                          max_seq_len: int, num_sms: int) -> set[tuple]:
    """The Triton variants one engine of this shape compiles (what `warm_up` launches), named so
    that engines of several shapes share what they share: the four fused ops, the paged kernel
    per split count and per chunk tile, the merge per split count above one."""
    splits = split_buckets(num_kv_heads, max_seq_len, num_sms)
    chunks = query_buckets(num_heads, num_kv_heads, head_dim, tokens_per_block)
    heads = (num_heads, num_kv_heads, head_dim)
    return ({("rms_norm", hidden_size, False), ("rms_norm", hidden_size, True),
             ("silu_mul", 2 * intermediate_size), ("rope_write_cache", *heads)}
            | {("paged_attention", *heads, tokens_per_block, 1, s) for s in splits}
            | {("paged_attention", *heads, tokens_per_block, q, 1) for q in chunks}
            | {("merge_splits", s, head_dim) for s in splits if s > 1})

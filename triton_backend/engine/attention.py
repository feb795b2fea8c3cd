"""Attention over a paged KV cache with packed (unpadded) tokens.

All tokens of a step are packed into one flat tensor [T, ...]. This is the pure-torch reference:
decodes (one new token each) are attended in one batched call over their gathered keys; prefill
chunks one sequence at a time with a causal mask offset by the tokens already in the cache. The C++
backend (`cpu/ops.py`) attends the first `kernel_rows` packed rows (short queries: decodes) with a
kernel that reads the paged cache in place, and the longer chunks after them (`prefill_runs`) with
a prefill kernel that reads it in place too. The metadata is built once per step by the model
runner and passed explicitly (no hidden global context).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from triton_backend.engine.kv_cache import PagedKVCache


@dataclass
class PrefillChunk:
    """One sequence's new tokens [q_start, q_end) in the packed tensor, after `num_cached` tokens."""

    q_start: int
    q_end: int
    num_cached: int
    key_slots: torch.Tensor | None  # slots of all num_cached + q_len keys; None when num_cached == 0


@dataclass
class PrefillRun:
    """Prefill chunks the C++ prefill kernel attends in one call: packed rows [row_begin, row_end),
    each chunk's keys named by its block table (of `tokens_per_block`), in the cache or, when
    `keys_as_computed`, among the run's own new rows (a prompt's first chunk over a one-byte
    cache attends its keys as computed, not as stored)."""

    row_begin: int
    row_end: int
    block_tables: torch.Tensor  # [B, max_blocks] int32 (0-padded)
    seq_lens: torch.Tensor      # [B] int32 keys per chunk, new ones included
    query_start: torch.Tensor   # [B + 1] int32 row offsets from row_begin
    tokens_per_block: int
    keys_as_computed: bool = False
    max_seq_len: int = 0        # the most keys a chunk sees (host-side, like the metadata's)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [T] where each new token's K/V is written
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The torch path's decodes:
    decode_token_index: torch.Tensor | None = None  # [n] positions of decode tokens in the packed tensor
    decode_key_slots: torch.Tensor | None = None    # [n, max_k] slots of each decode's keys (padded)
    decode_key_mask: torch.Tensor | None = None     # [n, 1, 1, max_k] True where a key is real
    # The paged kernel's sequences, packed first: rows [0, kernel_rows).
    kernel_rows: int = 0
    block_tables: torch.Tensor | None = None        # [B, max_blocks] int32 (0-padded)
    seq_lens: torch.Tensor | None = None            # [B] int32 keys per sequence, new ones included
    query_start: torch.Tensor | None = None         # [B + 1] int32 packed row offsets
    # Host-side bounds of the same sequences, for kernels that must not read the device.
    max_query_len: int = 0
    max_seq_len: int = 0
    # The prefill kernel's chunks, packed after the paged kernel's rows.
    prefill_runs: list[PrefillRun] = field(default_factory=list)


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, Hq, D].
    `window`: each row sees only the last `window` keys up to its own (a local layer)."""
    cache.write(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        out[chunk.q_start:chunk.q_end] = prefill_attention(layer, q, k, v, cache, chunk, scale,
                                                           window)
    if meta.decode_token_index is not None:
        out[meta.decode_token_index] = _decode(layer, q, cache, meta, scale, window)
    return out


def prefill_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache: PagedKVCache, chunk: PrefillChunk, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """One sequence's chunk: causal over its own new tokens, plus every cached token before
    (within `window` keys of each row, when given)."""
    qs = q[chunk.q_start:chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    q_len = chunk.q_end - chunk.q_start
    k_len = q_len if chunk.key_slots is None else chunk.key_slots.numel()
    if chunk.key_slots is None:
        ks, vs = k[chunk.q_start:chunk.q_end], v[chunk.q_start:chunk.q_end]
    else:
        ks, vs = cache.gather(layer, chunk.key_slots, q.dtype)
    mask, causal = None, True
    if chunk.key_slots is not None or (window is not None and k_len > window):
        rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (k_len - q_len)
        keys = torch.arange(k_len, device=q.device).unsqueeze(0)
        mask, causal = keys <= rows, False
        if window is not None:
            mask &= keys > rows - window
    ks = ks.transpose(0, 1).unsqueeze(0)
    vs = vs.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _decode(layer: int, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
            scale: float, window: int | None = None) -> torch.Tensor:
    qd = q[meta.decode_token_index].unsqueeze(2)            # [n, Hq, 1, D]
    ks, vs = cache.gather(layer, meta.decode_key_slots, q.dtype)  # [n, max_k, Hkv, D]
    mask = meta.decode_key_mask
    if window is not None:  # the real keys are the first num_keys: keep the last `window`
        num_keys = mask.sum(dim=-1, keepdim=True)
        mask = mask & (torch.arange(mask.shape[-1], device=q.device) >= num_keys - window)
    o = F.scaled_dot_product_attention(qd, ks.transpose(1, 2), vs.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)

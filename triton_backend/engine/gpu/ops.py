"""The GPU backend's per-layer operations: the torch reference's norms and activations, with
attention that reads the paged cache in place (the Triton kernel of `paged_attention.py`).

Every chunk with a cached prefix, and every decode, goes to the paged kernel in one launch per
layer; a prompt's first chunk is attended by torch's SDPA over its own keys as computed (flash
attention on a GPU: the prefill logits equal transformers' on the same device, and over a
one-byte cache the first chunk sees its keys unrounded, as TensorRT-LLM's context phase does).
Nothing here reads the device from the host, so a decode step can be captured in a CUDA graph.

Off CUDA (the tests, `forge gpu-check --device cpu`) the same step runs with the kernel's torch
reference, which reads the metadata on the host.
"""
from __future__ import annotations

import torch

from triton_backend.engine.attention import AttentionMetadata, _decode, prefill_attention
from triton_backend.engine.gpu.paged_attention import paged_attention, paged_attention_reference
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.ops import TorchOps

FP8_STORAGE = torch.uint8  # the one-byte FP8 cache's container (quant/kv_cache.py)


def split_count(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the keys for a decode batch: enough programs to fill the GPU's SMs twice when the
    batch is small, each split at least 256 keys long, at most 16."""
    programs = max(1, batch * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    return max(1, min(16, wanted, max_seq_len // 256 or 1))


class GpuOps(TorchOps):
    """`kernel_max_query` None: the paged kernel takes chunks of any length."""

    name = "gpu"
    kernel_max_query = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.use_kernel = device.type == "cuda"
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if self.use_kernel else 1)

    def reads_cache_in_place(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        return True

    def attends_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        return num_computed > 0  # a first chunk: SDPA over its keys as computed

    def attention(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                  cache: PagedKVCache, meta: AttentionMetadata, num_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, num_heads, head_dim)
        k = k.view(-1, num_kv_heads, head_dim)
        v = v.view(-1, num_kv_heads, head_dim)
        q, k = rotary(positions, q, k)
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        rows = meta.kernel_rows
        if rows:
            out[:rows] = self._paged(layer, q[:rows], cache, meta, scale)
        for chunk in meta.prefills:  # first chunks: SDPA over their own keys
            out[chunk.q_start:chunk.q_end] = prefill_attention(layer, q, k, v, cache, chunk, scale)
        if meta.decode_token_index is not None:  # decodes a caller routed to the reference
            out[meta.decode_token_index] = _decode(layer, q, cache, meta, scale)
        return out.view(-1, q_size)

    def _paged(self, layer: int, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if k_cache.dtype == FP8_STORAGE:
            k_cache, v_cache = (k_cache.view(torch.float8_e4m3fn),
                                v_cache.view(torch.float8_e4m3fn))
        k_scale, v_scale = cache.layer_scales(layer)
        if not self.use_kernel:
            return paged_attention_reference(q, k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, meta.query_start,
                                             cache.tokens_per_block, scale, k_scale, v_scale)
        splits = 1
        if meta.max_query_len == 1:
            splits = split_count(meta.block_tables.shape[0], k_cache.shape[1], meta.max_seq_len,
                                 self.num_sms)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start, cache.tokens_per_block, scale,
                               meta.max_query_len, k_scale, v_scale, splits)

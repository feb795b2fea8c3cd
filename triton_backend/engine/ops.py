"""The per-layer operations of the decoder, in two interchangeable backends.

`TorchOps` is the reference: plain torch ops, runs on any device. `CppOps` runs the same
operations through the CPU kernels of `cpu/csrc` (fused RMSNorm + residual, SiLU * up,
rotary + KV-cache write, paged decode attention that reads the cache in place), with one call
where torch needs several. Both round where the other rounds, so they agree up to fp32 summation
order; tests hold them to that.

Attention in `CppOps` is two kernels over the cache in place: the paged decode kernel for one-row
queries (`meta.kernel_rows`), the prefill kernel for longer ones (`meta.prefill_runs`).

The model calls `ops.<op>(...)`; which backend it gets is decided once at load
(`backend.select_ops`): the GPU backend (`gpu/ops.py`) on CUDA, the C++ one on a CPU when the
kernels built, the torch one otherwise (or when `LLM_FORGE_KERNELS=torch`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_backend.engine.attention import AttentionMetadata, paged_attention, prefill_attention
from triton_backend.engine.kv_cache import PagedKVCache

class TorchOps:
    name = "torch"

    def reads_cache_in_place(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        """Whether this backend's attention kernel reads `cache` without gathering it."""
        return False

    def attends_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        """Whether a chunk of `num_new` tokens after `num_computed` goes to the in-place kernel
        (packed first, `AttentionMetadata.kernel_rows`) rather than the prefill path."""
        return False

    def prefills_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        """Whether a chunk the in-place kernel does not take goes to an in-place prefill kernel
        (packed after it, `AttentionMetadata.prefill_runs`) rather than the torch path."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Computed in float32 and cast back, as transformers does."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual stream and the next input."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                num_heads: int, num_kv_heads: int, eps: float) -> torch.Tensor:
        """RMSNorm over each query and key head of the fused projection [T, q + 2 kv]."""
        head_dim = q_weight.numel()
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        q = self.rms_norm(q.reshape(-1, head_dim), q_weight, eps).reshape(q.shape)
        k = self.rms_norm(k.reshape(-1, head_dim), k_weight, eps).reshape(k.shape)
        return torch.cat((q, k, v), dim=-1)

    def sparse_moe(self, moe, x: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts MLP (`moe.SparseMoE`) over the step's rows."""
        return moe.grouped(x, self)

    def attention(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                  cache: PagedKVCache, meta: AttentionMetadata, num_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float, window: int | None = None
                  ) -> torch.Tensor:
        """Rotary on q and k, cache write, attention -> [T, num_heads * head_dim]. `window`:
        a local layer's span (each row sees the last `window` keys up to its own)."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, num_heads, head_dim)
        k = k.view(-1, num_kv_heads, head_dim)
        v = v.view(-1, num_kv_heads, head_dim)
        q, k = rotary(positions, q, k)
        return paged_attention(layer, q, k, v, cache, meta, scale, window).reshape(-1, q_size)


class CppOps(TorchOps):
    """The C++ kernels (`torch.ops.llm_forge`); load them before constructing."""

    name = "cpp"

    def __init__(self) -> None:
        self._ops = torch.ops.llm_forge

    def reads_cache_in_place(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        return cache.kernel_reads(dtype)

    def attends_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        # One new row (a decode) takes the paged kernel, which splits a long context over the
        # threads; two or more (a chunk of a prompt, a decode with its draft tokens) the prefill
        # kernel, which reads each key once for all of them where the paged kernel reads it once
        # per row (bf16, 9 query heads over 3 kv heads, one thread of a Zen 5 EPYC: 2 rows over
        # 2,048 keys 1.7x as fast, 5 rows 4.5x, 64 rows 7.9x). Both run in the one-call decode
        # path (kernels/forward.py). Over a one-byte cache a prompt's first chunk attends its keys
        # as computed, not as stored (as the torch path does, and TensorRT-LLM's context phase):
        # the prefill kernel reads them from the step's own rows.
        return num_new == 1 and not (one_byte_cache and num_computed == 0)

    def prefills_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        return True

    def rms_norm(self, x, weight, eps):
        return self._ops.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        # The residual stream is updated in place: it is this step's own buffer.
        return self._ops.add_rms_norm(x.contiguous(), residual, weight, eps), residual

    def silu_mul(self, gate_up):
        return self._ops.silu_mul(gate_up.contiguous())

    def gelu_tanh_mul(self, gate_up):
        return self._ops.gelu_tanh_mul(gate_up.contiguous())

    def qk_norm(self, qkv, q_weight, k_weight, num_heads, num_kv_heads, eps):
        qkv = qkv.contiguous()  # normed in place: the projection's own output
        self._ops.qk_norm_(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)
        return qkv

    def sparse_moe(self, moe, x):
        from triton_backend.engine.cpu import moe as cpu_moe
        return cpu_moe.sparse_moe(moe, x) if cpu_moe.covers(moe, x) else moe.grouped(x, self)

    def attention(self, layer, qkv, positions, rotary, cache, meta, num_heads, num_kv_heads,
                  head_dim, scale, window=None):
        if not cache.kernel_reads(qkv.dtype):
            return super().attention(layer, qkv, positions, rotary, cache, meta, num_heads,
                                     num_kv_heads, head_dim, scale, window)
        qkv = qkv.contiguous()
        # A one-byte cache (int8, FP8) is quantized on write and widened on read by the kernels.
        k_scale, v_scale = cache.layer_scales(layer)
        self._ops.rope_write_cache(qkv, positions, rotary.cos, rotary.sin, num_heads,
                                   num_kv_heads, cache.k[layer], cache.v[layer],
                                   meta.slot_mapping, k_scale, v_scale)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(-1, num_heads, head_dim)
        out = torch.empty_like(q)
        rows = meta.kernel_rows
        if rows:  # short queries (decodes): the paged kernel, in place over the cache
            out[:rows] = self._ops.paged_attention(
                q[:rows], cache.k[layer], cache.v[layer], meta.block_tables, meta.seq_lens,
                meta.query_start, cache.tokens_per_block, scale, k_scale, v_scale, window or 0)
        for run in meta.prefill_runs:  # long chunks: the prefill kernel, written into out
            span = slice(run.row_begin, run.row_end)
            keys, values, scales = cache.k[layer], cache.v[layer], (k_scale, v_scale)
            if run.keys_as_computed:  # the run's own rotated rows, in the activations' dtype
                keys = qkv[span, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
                values = qkv[span, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
                scales = (1.0, 1.0)
            if window is not None and run.max_seq_len > window:
                # The prefill kernel attends every key up to a row; the paged kernel stops at
                # the window (reading each key once per row: local layers' long prompts only).
                out[span] = self._ops.paged_attention(
                    q[span], keys.contiguous(), values.contiguous(), run.block_tables,
                    run.seq_lens, run.query_start, run.tokens_per_block, scale, *scales, window)
                continue
            self._ops.prefill_attention(out[span], q[span], keys, values, run.block_tables,
                                        run.seq_lens, run.query_start, run.tokens_per_block,
                                        scale, *scales)
        if meta.prefills:  # chunks routed to torch's flash attention over the rotated q, k, v
            k = qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
            for chunk in meta.prefills:
                out[chunk.q_start:chunk.q_end] = prefill_attention(layer, q, k, v, cache, chunk,
                                                                   scale, window)
        return out.view(-1, q_size)

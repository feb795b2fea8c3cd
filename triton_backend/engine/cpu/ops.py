"""The CPU backend: the decoder's operations through the C++ kernels of `csrc/` (fused RMSNorm +
residual, SiLU / GELU-tanh * up, QK-norm, rotary + KV-cache write, paged decode attention and
prefill attention that read the cache in place), with one call where torch needs several.

Attention is two kernels over the cache in place: the paged decode kernel for one-row queries
(`meta.kernel_rows`), the prefill kernel for longer ones (`meta.prefill_runs`). At load
(`prepare`) the projections are packed for the GEMM this machine measured (`linear.py`), the LM
head quantized when asked, adapters packed alike, and steps of little work take the one-call
decode path (`forward.py`); a mixture of experts runs every routed expert in one call (`moe.py`).
"""
from __future__ import annotations

import torch

from triton_backend.engine.attention import prefill_attention
from triton_backend.engine.cpu.forward import DecodeForward
from triton_backend.engine.cpu.kernels import plan_key
from triton_backend.engine.cpu.linear import PackedBf16Linear, bf16_gemm_plan, pack_linears
from triton_backend.engine.cpu import moe as cpu_moe
from triton_backend.engine.cpu.quantized import pack_int4_linears, quantize_lm_head
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.ops import TorchOps

# The one-call decode path runs a whole step inside one C++ call, where the engine's progress
# count (progress.py) cannot move; what it saves is per-op dispatch, which matters only in short
# steps. So only steps of at most this much work (rows x projection weights) take it: 256 rows
# of SmolLM2-135M (2048 rows ran 40 s in one call on a heavily loaded 2-core machine, where the
# watchdog would have killed it); decode batches of small models stay in it.
ONE_CALL_MAX_WORK = 256 * 110_000_000


class CppOps(TorchOps):
    """The C++ kernels (`torch.ops.llm_forge`); load them before constructing."""

    name = "cpp"

    def __init__(self) -> None:
        self._ops = torch.ops.llm_forge
        self.greedy_pick = self._ops.greedy_pick
        self.lora_add_rows = self._ops.lora_add_rows
        self.decode_forward = None
        self.one_call_max_rows = 0

    def prepare(self, model, kv_cache, config, dtype, lora, num_blocks, cuda_graphs=True):
        """Pack the projections for the measured bf16 GEMM (adapters too) and the INT4 kernels,
        quantize the LM head when asked, and set up the one-call decode path."""
        pack_int4_linears(model, plan_key())
        if dtype == torch.bfloat16:
            plan = bf16_gemm_plan(plan_key())
            if plan.packed:
                pack_linears(model, plan)
                if lora is not None:  # adapters take the same kernel
                    lora.pack = lambda w: PackedBf16Linear(w.to(torch.bfloat16), None,
                                                           plan.upcast_min_rows, plan.layout)
        cpu_moe.prepare_moe(model)  # after packing: bf16 experts become views of the stacks
        if config.quantization.lm_head == "int8" and not quantize_lm_head(model):
            raise ValueError("quantization.lm_head: int8 needs the CPU kernels and an "
                             "in_features divisible by 32")
        self.bind(model, kv_cache, config, dtype)
        if self.inputs.kernel_attention:
            self.decode_forward = DecodeForward(model, kv_cache, dtype)
            weights = self.decode_forward.weights_per_row  # a mixture's experts all counted
            self.one_call_max_rows = max(1, ONE_CALL_MAX_WORK // max(1, weights))

    def forward(self, input_ids, positions, meta, lora):
        """A short step whose layers the one-call path covers runs all of them in one C++ call."""
        if (self.decode_forward is not None and len(input_ids) <= self.one_call_max_rows
                and self.decode_forward.covers(meta, len(input_ids))):
            return self.decode_forward(input_ids, positions, meta, lora)
        return super().forward(input_ids, positions, meta, lora)

    def stats(self):
        return dict(super().stats(), cpp_kernels=1)

    def sparse_moe(self, moe, x):
        """Every routed expert in one C++ call where the fused kernel covers the layer."""
        if cpu_moe.covers(moe, x):
            return cpu_moe.sparse_moe(moe, x)
        return super().sparse_moe(moe, x)

    def reads_cache_in_place(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        return cache.kernel_reads(dtype)

    def attends_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        # One new row (a decode) takes the paged kernel, which splits a long context over the
        # threads; two or more (a chunk of a prompt, a decode with its draft tokens) the prefill
        # kernel, which reads each key once for all of them where the paged kernel reads it once
        # per row (bf16, 9 query heads over 3 kv heads, one thread of a Zen 5 EPYC: 2 rows over
        # 2,048 keys 1.7x as fast, 5 rows 4.5x, 64 rows 7.9x). Both run in the one-call decode
        # path (forward.py). Over a one-byte cache a prompt's first chunk attends its keys
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
            # A local layer's rows see their last `window` keys only (the kernel starts each
            # work item at its window, where the paged kernel read every key once per row).
            self._ops.prefill_attention(out[span], q[span], keys, values, run.block_tables,
                                        run.seq_lens, run.query_start, run.tokens_per_block,
                                        scale, *scales, window or 0)
        if meta.prefills:  # chunks routed to torch's flash attention over the rotated q, k, v
            k = qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
            for chunk in meta.prefills:
                out[chunk.q_start:chunk.q_end] = prefill_attention(layer, q, k, v, cache, chunk,
                                                                   scale, window)
        return out.view(-1, q_size)

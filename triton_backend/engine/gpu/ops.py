"""The GPU backend's per-layer operations: RMSNorm with the residual add, SiLU * up, and rotary
with the KV-cache write as one Triton kernel each (`fused.py`), and attention that reads the
paged cache in place (the Triton kernel of `paged_attention.py`).

Every chunk goes to the paged kernel, all of a step's in one launch per layer: decodes, chunks
over a cached prefix and prompts' first chunks alike (varlen, causal, GQA, the keys read from
the cache where the rotary kernel has just written them), so a prefill of many prompts is not
one attention call per sequence and layer. Over a one-byte cache a prompt's first chunk attends
its keys as computed, unrounded (as TensorRT-LLM's context phase does): the same kernel, run
over the step's own rotated keys and values as a cache of one-token blocks (`prefill_runs`).
Nothing here reads the device from the host, so a decode step can be captured in a CUDA graph.

Off CUDA (the tests, `forge gpu-check --device cpu`) the same step runs with the kernel's torch
reference, which reads the metadata on the host.
"""
from __future__ import annotations

import math
import os

import torch

from triton_backend.engine.attention import AttentionMetadata, _decode, prefill_attention
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.gpu import fused
from triton_backend.engine.gpu.graphs import CUDA_GRAPHS_ENV, DecodeGraphs, capture_sizes
from triton_backend.engine.gpu.moe import fused_moe, stacked_experts
from triton_backend.engine.gpu.sampling import DeviceSampler
from triton_backend.engine.gpu.paged_attention import (launch_constants, paged_attention,
                                                       paged_attention_reference, split_count,
                                                       variant_key)
from triton_backend.engine.gpu.triton_support import available, interpreted
from triton_backend.engine.gpu.variants import VARIANTS
from triton_backend.engine.gpu.warmup import warm_up
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.moe import route
from triton_backend.engine.ops import Launched, TorchOps
from triton_backend.engine.sampler import below_min_tokens

KV_KINDS = {"auto": 0, "int8": 1, "fp8": 2}  # the fused cache write's formats


def _cache_views(cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values as the kernels read them: an FP8 cache, kept in a uint8
    container (quant/kv_cache.py), seen as float8_e4m3fn."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if getattr(cache, "kv_dtype", "auto") == "fp8":
        return k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
    return k_cache, v_cache


class GpuOps(TorchOps):
    """`kernel_max_query` None: the paged kernel takes chunks of any length."""

    name = "gpu"
    kernel_max_query = None
    # The captured steps' padded rows write to one block past the pool, which nobody owns.
    extra_kv_blocks = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The kernels on CUDA; on a CPU only under Triton's interpreter (the tests), else the
        # torch references.
        self.use_kernel = device.type == "cuda" or (available() and interpreted())
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        if device.type == "cuda":
            VARIANTS.hook_compiles()
        self.graphs = None

    def graph_sizes(self, config: EngineConfig, cuda_graphs: bool) -> list[int]:
        """None without graphs. A mixture of experts groups its rows by expert (a data-dependent
        shape), which a captured graph cannot replay: its steps run eagerly."""
        if (os.environ.get(CUDA_GRAPHS_ENV, "1") == "0" or not cuda_graphs
                or config.model.num_experts):
            return []
        return capture_sizes(config.limits.max_batch_size)

    def prepare(self, model, kv_cache, config, dtype, lora, num_blocks, cuda_graphs=True):
        """Sampling on the device, every Triton kernel variant compiled (warmup.py), and decode
        steps captured as CUDA graphs (unless turned off), their padded rows writing to the block
        past the pool."""
        super().prepare(model, kv_cache, config, dtype, lora, num_blocks)
        self.device_sampler = DeviceSampler()
        self.prepare_model(model)
        self.config, self.pad_slot = config, num_blocks * config.kv_cache.tokens_per_block
        with warm_up(model, kv_cache, self, self.pad_slot, config.limits.max_seq_len):
            if self.graph_sizes(config, cuda_graphs):
                self.capture_graphs()

    def capture_graphs(self) -> None:
        """Capture the decode steps; from then on they replay."""
        limits = self.config.limits
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self, limits.max_batch_size,
                                   limits.max_seq_len, self.pad_slot, self.device)
        with torch.inference_mode():
            self.graphs.capture()

    def launch(self, chunks, lora, return_logits):
        """A decode step a captured graph covers replays it (every row samples, one each)."""
        if (self.graphs is not None and not return_logits and self.graphs.covers(chunks)
                and all(c.needs_sample for c in chunks)):
            logits, greedy = self.graphs.run(chunks)
            return Launched(logits, None, greedy)
        return super().launch(chunks, lora, return_logits)

    def greedy_picks(self, launched, chunks, eos_ids):
        """The graph's own greedy picks, when every row is plain greedy (nothing masked, no
        alternatives asked) and none saw a non-finite logit: the step's one copy to the host."""
        if launched.greedy is None or not all(
                c.request.sampling.greedy and not c.request.top_log_probs
                and self.device_sampler.takes(c) and not below_min_tokens(c, eos_ids[c.seq_id])
                for c in chunks):
            return None
        picks = launched.greedy.cpu().tolist()
        if not all(math.isfinite(log_prob) for _, log_prob in picks):
            return None
        return {c.seq_id: (int(token), log_prob) for c, (token, log_prob) in zip(chunks, picks)}

    def release(self, seq_id: int) -> None:
        if self.device_sampler is not None:
            self.device_sampler.release(seq_id)

    def reset_sampling(self) -> None:
        if self.device_sampler is not None:
            self.device_sampler = DeviceSampler()

    def stats(self) -> dict[str, int]:
        """Captured decode graphs and how many steps replayed one, and the kernel variants."""
        graphs = self.graphs
        return dict(super().stats(), gpu_backend=1, **self.kernel_stats(),
                    cuda_graphs=len(graphs.graphs) if graphs is not None else 0,
                    cuda_graph_replays=graphs.num_replays if graphs is not None else 0)

    def reads_cache_in_place(self, cache: PagedKVCache, dtype: torch.dtype) -> bool:
        return True

    def attends_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        return num_computed > 0 or not one_byte_cache

    def prefills_in_place(self, num_new: int, num_computed: int, one_byte_cache: bool) -> bool:
        return True  # a first chunk over a one-byte cache: its keys as computed

    def prepare_model(self, model: torch.nn.Module) -> None:
        """At load: FP8 projections quantize their input in one kernel (gpu/fp8.py)."""
        if self.use_kernel:
            from triton_backend.engine.gpu.fp8 import fuse_fp8_inputs

            fuse_fp8_inputs(model)

    def kernel_stats(self) -> dict[str, int]:
        """For the engine's stats: kernel variants launched in this process, and those first
        launched after the start-up warm-up (each a compile while serving, on a GPU)."""
        return {"triton_kernel_variants": VARIANTS.num_variants,
                "triton_compiles": VARIANTS.num_compiles,
                "triton_compiles_after_warmup": VARIANTS.compiles_after_warmup}

    def rms_norm(self, x, weight, eps):
        VARIANTS.note("rms_norm", str(x.dtype), x.shape[-1], False)
        if not self.use_kernel:
            return super().rms_norm(x, weight, eps)
        return fused.add_rms_norm(x.contiguous(), None, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        VARIANTS.note("rms_norm", str(x.dtype), x.shape[-1], True)
        if not self.use_kernel:
            return super().add_rms_norm(x, residual, weight, eps)
        return fused.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)

    def silu_mul(self, gate_up):
        VARIANTS.note("silu_mul", str(gate_up.dtype), gate_up.shape[-1])
        if not self.use_kernel:
            return super().silu_mul(gate_up)
        return fused.silu_mul(gate_up.contiguous())

    def gelu_tanh_mul(self, gate_up):
        VARIANTS.note("gelu_tanh_mul", str(gate_up.dtype), gate_up.shape[-1])
        if not self.use_kernel:
            return super().gelu_tanh_mul(gate_up)
        return fused.silu_mul(gate_up.contiguous(), gelu=True)

    def sparse_moe(self, moe, x):
        stacked = stacked_experts(moe) if self.use_kernel else None
        if stacked is None:
            return super().sparse_moe(moe, x)
        weights, experts = route(moe.router(x), moe.top_k, moe.renormalise)
        return fused_moe(x.contiguous(), *stacked, weights, experts, silu=moe.experts[0].silu)

    def attention(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rotary,
                  cache: PagedKVCache, meta: AttentionMetadata, num_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float, window: int | None = None
                  ) -> torch.Tensor:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        v = qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
        kv_kind = KV_KINDS[getattr(cache, "kv_dtype", "auto")]
        VARIANTS.note("rope_write_cache", str(qkv.dtype), num_heads, num_kv_heads, head_dim,
                      kv_kind)
        if self.use_kernel:  # rotary and the cache write in one kernel
            k_cache, v_cache = _cache_views(cache, layer)
            k_scale, v_scale = cache.layer_scales(layer)
            q, k = fused.rope_write_cache(
                qkv.contiguous(), positions, rotary.cos, rotary.sin, num_heads, num_kv_heads,
                head_dim, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, kv_kind)
        else:
            q = qkv[:, :q_size].view(-1, num_heads, head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
            q, k = rotary(positions, q, k)
            cache.write(layer, meta.slot_mapping, k, v)
        rows = meta.kernel_rows
        if rows == q.shape[0]:  # every chunk from the cache (always, but over one-byte caches)
            return self._paged(layer, q, cache, meta, scale, window).view(-1, q_size)
        out = torch.empty_like(q)
        if rows:
            out[:rows] = self._paged(layer, q[:rows], cache, meta, scale, window)
        for run in meta.prefill_runs:  # first chunks over a one-byte cache: keys as computed
            begin, end = run.row_begin, run.row_end
            out[begin:end] = self._attend(q[begin:end], k[begin:end].contiguous(),
                                          v[begin:end].contiguous(),
                                          run.block_tables, run.seq_lens, run.query_start,
                                          run.tokens_per_block, scale, 1.0, 1.0, end - begin, 1,
                                          window)
        for chunk in meta.prefills:  # chunks a caller routed to the torch path
            out[chunk.q_start:chunk.q_end] = prefill_attention(layer, q, k, v, cache, chunk, scale,
                                                               window)
        if meta.decode_token_index is not None:  # decodes a caller routed to the reference
            out[meta.decode_token_index] = _decode(layer, q, cache, meta, scale, window)
        return out.view(-1, q_size)

    def _paged(self, layer: int, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
               scale: float, window: int | None) -> torch.Tensor:
        k_cache, v_cache = _cache_views(cache, layer)
        k_scale, v_scale = cache.layer_scales(layer)
        splits = 1
        if meta.max_query_len == 1:
            splits = split_count(meta.block_tables.shape[0], k_cache.shape[1], meta.max_seq_len,
                                 self.num_sms)
        return self._attend(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start, cache.tokens_per_block, scale, k_scale, v_scale,
                            meta.max_query_len, splits, window)

    def _attend(self, q, k_cache, v_cache, block_tables, seq_lens, query_start,
                tokens_per_block: int, scale: float, k_scale: float, v_scale: float,
                max_query_len: int, splits: int, window: int | None = None) -> torch.Tensor:
        """The paged kernel (its variant noted), or its reference off CUDA; `window`: a
        local layer's span."""
        constants = launch_constants(q.dtype, k_cache.element_size() == 1, q.shape[1],
                                     k_cache.shape[1], q.shape[2], tokens_per_block,
                                     max_query_len, splits)
        VARIANTS.note("paged_attention", *variant_key(constants, q.dtype, k_cache.dtype))
        if splits > 1:
            VARIANTS.note("merge_splits", splits, q.shape[2])
        if not self.use_kernel:
            return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                             query_start, tokens_per_block, scale, k_scale,
                                             v_scale, window or 0)
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start,
                               tokens_per_block, scale, max_query_len, k_scale, v_scale, splits,
                               window=window or 0)

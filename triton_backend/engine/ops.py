"""A device backend: the per-layer operations of the decoder, and its part in a model runner.

`TorchOps` is the reference backend: plain torch ops, runs on any device. The CPU backend
(`cpu/ops.py`: the C++ kernels) and the GPU backend (`gpu/ops.py`: Triton kernels, CUDA graphs)
subclass it, rounding where it rounds, so they agree up to fp32 summation order; tests hold them
to that. Which one a runner gets is decided once at load (`backend.select_ops`).

A backend is one interface the model runner calls without asking which backend it is:
`prepare` makes the loaded model, its KV cache and adapters ready for the device (packing,
warm-up, graph capture) and sets up the step's inputs (`step_inputs.StepInputs`, routed by
`attends_in_place` / `prefills_in_place`); `launch` runs a step (the backend's fast step where
it covers it: captured graphs on the GPU, the one-call decode on the CPU) and returns its logits;
`greedy_picks` reads a fast step's own greedy picks; `device_sampler`, `greedy_pick` and
`lora_add_rows` are the backend's sampling and adapter kernels (None: the torch paths); `stats`
its counters. The model calls `ops.<op>(...)` per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from triton_backend.engine.attention import AttentionMetadata, paged_attention
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.device import host_to_device
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.quant.linear import Int4WeightOnlyLinear
from triton_backend.engine.step_inputs import StepInputs


@dataclass
class Launched:
    """A launched step: the logits of the rows that sample (float32 [n, V]; None when none
    does), every packed row's when asked for, and the backend's own greedy pick of each sampling
    row ([n, 2]: token id, log prob) when its fast step computed them."""

    logits: torch.Tensor | None
    all_logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None


class TorchOps:
    name = "torch"
    extra_kv_blocks = 0   # blocks past the pool the backend's own step writes
    device_sampler = None  # samples on the device the rows it takes (gpu/sampling.py)
    greedy_pick = None     # (logits, masked rows, masked ids) -> (ids, log probs), on the host
    lora_add_rows = None   # adds an adapter's delta to a few rows in one pass (lora/batch.py)

    def graph_sizes(self, config: EngineConfig, cuda_graphs: bool) -> list[int]:
        """The decode batch sizes the backend captures at load (their memory is kept out of
        the KV pool's budget: kv_pool.free_memory_blocks)."""
        return []

    def prepare(self, model, kv_cache: PagedKVCache, config: EngineConfig, dtype: torch.dtype,
                lora, num_blocks: int, cuda_graphs: bool = True) -> None:
        """Make a loaded model, its KV cache (`num_blocks` the block manager hands out) and its
        adapter cache (`lora`, or None) ready for this backend's steps."""
        if config.quantization.lm_head == "int8":
            raise ValueError("quantization.lm_head: int8 needs the CPU kernels and an "
                             "in_features divisible by 32")
        for module in model.modules():  # INT4 layers on a CPU: torch's own kernel
            if isinstance(module, Int4WeightOnlyLinear):
                module.use_int4pack()
        self.bind(model, kv_cache, config, dtype)

    def bind(self, model, kv_cache: PagedKVCache, config: EngineConfig, dtype: torch.dtype
             ) -> None:
        """The model and cache this backend's steps run on, and their inputs' builder."""
        self.model, self.kv_cache = model, kv_cache
        self.inputs = StepInputs(self, config.kv_cache.tokens_per_block, kv_cache.k.device,
                                 self.reads_cache_in_place(kv_cache, dtype),
                                 kv_cache.k.element_size() == 1)

    def launch(self, chunks, lora, return_logits: bool) -> Launched:
        """Run a step over `chunks` (in `inputs.packing_order`); logits, when asked for, are
        [T, V] in packed-row order."""
        input_ids, positions, meta, sample_rows = self.inputs.prepare(chunks)
        hidden = self.forward(input_ids, positions, meta, lora)
        all_logits = self.model.logits(hidden) if return_logits else None
        if not sample_rows:
            return Launched(None, all_logits)
        rows = host_to_device(sample_rows, torch.long, self.inputs.device)
        logits = all_logits[rows] if all_logits is not None else self.model.logits(hidden[rows])
        return Launched(logits, all_logits)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, lora) -> torch.Tensor:
        """The step's hidden states [T, hidden], every layer."""
        return self.model(input_ids, positions, self.kv_cache, meta, self, lora)

    def greedy_picks(self, launched: Launched, chunks, eos_ids: dict[int, frozenset[int]]
                     ) -> dict[int, tuple[int, float]] | None:
        """seq_id -> (token, log prob) from a fast step's own greedy picks, when they serve
        every row; None: sample the logits."""
        return None

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's sampling state on the device."""

    def reset_sampling(self) -> None:
        """Forget every sequence's sampling state on the device."""

    def stats(self) -> dict[str, int]:
        """For the engine's stats: which backend runs, and its fast step's counters."""
        return {"cpp_kernels": 0, "gpu_backend": 0, "cuda_graphs": 0, "cuda_graph_replays": 0}

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

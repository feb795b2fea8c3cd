"""How many KV blocks an engine gets, and the storage that holds them.

`plan_pool` decides it once, for every caller: an explicit block count, else a memory budget,
else the engine's own setting. On a CUDA GPU the budget can instead be a fraction of the memory
left free once the weights are loaded and what a step holds is set aside (`step_reserve`: the activations of `max_num_tokens`
rows, a full chunk's logits, the sampler's temporaries, the captured graphs' outputs)
(`kv_cache_free_gpu_mem_fraction`, as TensorRT-LLM sizes its cache).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)


def kv_bytes_per_token(config: EngineConfig, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers, in the cache's storage format."""
    if config.kv_cache.dtype != "auto":
        from triton_backend.engine.quant import quantized_kv_bytes_per_token

        return quantized_kv_bytes_per_token(config)
    return PagedKVCache.bytes_per_token(config.model, dtype)


@dataclass(frozen=True)
class PoolPlan:
    """How the KV pool is sized, decided once (`plan_pool`): `num_blocks`, or, on a CUDA device,
    `fraction` of the memory free once the weights are loaded (`num_blocks` None until then);
    `source` names the knob that decided it."""

    num_blocks: int | None
    source: str
    fraction: float | None = None

    def resolve(self, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                graph_sizes: list[int] | tuple[int, ...] = ()) -> int:
        """The block count, the free memory measured now where a fraction sizes the pool; logged
        once, with the knob that decided it."""
        blocks = self.num_blocks
        if blocks is None:
            blocks = free_memory_blocks(config, dtype, device, self.fraction, graph_sizes)
        tokens = blocks * config.kv_cache.tokens_per_block
        log.info("KV pool: %d blocks, %d tokens, %.2f GiB (from %s)", blocks, tokens,
                 tokens * kv_bytes_per_token(config, dtype) / 2**30, self.source)
        return blocks


def plan_pool(config: EngineConfig, dtype: torch.dtype, device: torch.device | None = None,
              kv_cache_num_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
              kv_cache_free_gpu_mem_fraction: float | None = None) -> PoolPlan:
    """The one precedence of the pool's knobs: an explicit block count, an explicit memory
    budget, on a CUDA `device` a fraction of the free memory (the one given, else the engine's
    `kv_cache.free_gpu_mem_fraction`), the engine's own `kv_cache.memory_bytes` or
    `kv_cache.num_blocks`, else enough for max_batch_size sequences of max_seq_len tokens."""
    kv = config.kv_cache
    if kv_cache_num_blocks is not None:
        return PoolPlan(kv_cache_num_blocks, "kv_cache_num_blocks")
    if kv_cache_memory_bytes is not None:
        return PoolPlan(blocks_in(config, dtype, kv_cache_memory_bytes), "kv_cache_memory_bytes")
    if device is not None and device.type == "cuda":
        if kv_cache_free_gpu_mem_fraction is not None:
            return PoolPlan(None, "kv_cache_free_gpu_mem_fraction", kv_cache_free_gpu_mem_fraction)
        if kv.free_gpu_mem_fraction is not None:
            return PoolPlan(None, "kv_cache.free_gpu_mem_fraction", kv.free_gpu_mem_fraction)
    if kv.memory_bytes is not None:
        return PoolPlan(blocks_in(config, dtype, kv.memory_bytes), "kv_cache.memory_bytes")
    if kv.num_blocks is not None:
        return PoolPlan(kv.num_blocks, "kv_cache.num_blocks")
    tokens = config.limits.max_batch_size * config.limits.max_seq_len
    return PoolPlan(-(-tokens // kv.tokens_per_block), "limits.max_batch_size x max_seq_len")


def blocks_in(config: EngineConfig, dtype: torch.dtype, budget_bytes: int) -> int:
    """Whole blocks that fit `budget_bytes` (at least one)."""
    block_bytes = kv_bytes_per_token(config, dtype) * config.kv_cache.tokens_per_block
    return max(1, budget_bytes // block_bytes)


def make_kv_cache(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                  num_blocks: int) -> PagedKVCache:
    if config.kv_cache.dtype != "auto":
        from triton_backend.engine.quant import make_quantized_kv_cache  # optional runtime half

        return make_quantized_kv_cache(config, num_blocks, device)
    return PagedKVCache(config.model, num_blocks, config.kv_cache.tokens_per_block, dtype, device)


# cuBLAS workspaces, the CUDA context's own allocations and the allocator's slack.
GPU_RUNTIME_RESERVE_BYTES = 512 * 2**20
# The device sampler's float32/int64 [rows, V] temporaries per logit, as gpu/sampling.py makes
# them at most (a seeded top-k/top-p row): about 13 float32 copies (the logits, NaN-cleaned,
# scaled, log-softmaxed, sorted, masked twice, softmaxed, summed, scattered back, the noise and
# its two logs), 4 int64 (the sort order, the hashed ids, their bits, the ranks) and 3 masks.
SAMPLER_BYTES_PER_LOGIT = 13 * 4 + 4 * 8 + 3


@dataclass(frozen=True)
class StepReserve:
    """The GPU memory kept out of the KV pool, in bytes, by what holds it."""

    activations: int     # max_num_tokens rows through a layer
    prefill_logits: int  # the [max_num_tokens, V] logits of a full chunk asked for all rows
    sampler: int         # the device sampler's temporaries over every sampling row
    graphs: int          # each captured size's logits kept, and the largest one's activations
    runtime: int = GPU_RUNTIME_RESERVE_BYTES

    @property
    def total(self) -> int:
        return (self.activations + self.prefill_logits + self.sampler + self.graphs
                + self.runtime)

    def describe(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {value / 2**20:.0f}"
                          for name, value in self.__dict__.items())
        return f"{self.total / 2**30:.2f} GiB ({parts} MiB)"


def _activation_bytes_per_row(config: EngineConfig, dtype: torch.dtype) -> int:
    """A row through a layer: hidden and residual, QKV and its rotated copies, the attention
    output, the gate/up projection and its product, each once more for the op producing the
    next."""
    shape = config.model
    per_row = (4 * shape.hidden_size + 3 * (shape.q_size + 2 * shape.kv_size)
               + 3 * shape.intermediate_size)
    return 2 * per_row * dtype.itemsize


def step_reserve(config: EngineConfig, dtype: torch.dtype,
                 graph_sizes: list[int] | tuple[int, ...] = ()) -> StepReserve:
    """What a step can hold besides the weights and the KV pool: `max_num_tokens` rows of
    activations, a full chunk's logits (the LM head's output in `dtype`, then float32), the
    sampler's temporaries over `max_batch_size` rows (and their drafts, with speculative
    decoding on), and, for decode graphs
    captured at `graph_sizes`, the logits each graph keeps as its output (float32, with its
    greedy picks) plus the largest graph's activations and LM head output in their shared pool."""
    limits, vocab = config.limits, config.model.vocab_size
    per_row = _activation_bytes_per_row(config, dtype)
    spec = config.speculative
    sampling_rows = limits.max_batch_size * (1 + (spec.num_draft_tokens if spec.enabled else 0))
    graphs = 0
    if graph_sizes:
        largest = max(graph_sizes)
        graphs = (sum(size * (vocab * 4 + 2 * 8) for size in graph_sizes)
                  + largest * (per_row + vocab * dtype.itemsize))
    return StepReserve(activations=limits.max_num_tokens * per_row,
                       prefill_logits=limits.max_num_tokens * vocab * (dtype.itemsize + 4),
                       sampler=sampling_rows * vocab * SAMPLER_BYTES_PER_LOGIT, graphs=graphs)


def free_memory_blocks(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                       fraction: float, graph_sizes: list[int] | tuple[int, ...] = ()) -> int:
    """Blocks for `fraction` of the GPU memory free now (weights loaded), once the step's
    reserve (`step_reserve`, logged) is set aside. Raises ValueError naming the fraction and the
    reserve when not even one sequence of max_seq_len tokens fits."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = step_reserve(config, dtype, graph_sizes)
    log.info("KV pool on %s: %.2f GiB free after loading, %s kept for a step", device,
             free / 2**30, reserve.describe())
    budget = int(max(0, free - reserve.total) * fraction)
    blocks = blocks_in(config, dtype, budget)
    tokens = blocks * config.kv_cache.tokens_per_block
    if tokens < config.limits.max_seq_len:
        raise ValueError(
            f"kv_cache_free_gpu_mem_fraction {fraction}: {free / 2**30:.2f} GiB of "
            f"{total / 2**30:.2f} GiB are free on {device} after loading, "
            f"{reserve.describe()} are kept for a step, and the rest holds {tokens} tokens, "
            f"fewer than limits.max_seq_len ({config.limits.max_seq_len})")
    return blocks

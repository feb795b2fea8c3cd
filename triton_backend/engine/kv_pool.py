"""How many KV blocks an engine gets, and the storage that holds them.

The pool is an explicit block count, else a memory budget, else the engine's own setting. On a
CUDA GPU the budget can instead be a fraction of the memory left free once the weights are
loaded and a step of `max_num_tokens` rows has run (`kv_cache_free_gpu_mem_fraction`, as
TensorRT-LLM sizes its cache), measured by the runner that owns the device (`free_gpu_bytes`).
"""
from __future__ import annotations

import torch

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_cache import PagedKVCache


def kv_bytes_per_token(config: EngineConfig, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers, in the cache's storage format."""
    if config.kv_cache.dtype != "auto":
        from triton_backend.engine.quant import quantized_kv_bytes_per_token

        return quantized_kv_bytes_per_token(config)
    return PagedKVCache.bytes_per_token(config.model, dtype)


def resolve_num_blocks(config: EngineConfig, dtype: torch.dtype, num_kv_blocks: int | None = None,
                       kv_cache_memory_bytes: int | None = None) -> int:
    """Blocks in the KV pool: an explicit count, else a memory budget, else the engine's setting,
    else enough for max_batch_size sequences of max_seq_len tokens."""
    kv = config.kv_cache
    if num_kv_blocks is not None:
        return num_kv_blocks
    budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else kv.memory_bytes
    if budget is None and kv.num_blocks is not None:
        return kv.num_blocks
    if budget is not None:
        return blocks_in(config, dtype, budget)
    tokens = config.limits.max_batch_size * config.limits.max_seq_len
    return -(-tokens // kv.tokens_per_block)


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


# cuBLAS workspaces, the CUDA graphs' pool and the allocator's slack, beside a step's tensors.
GPU_RUNTIME_RESERVE_BYTES = 512 * 2**20


def step_activation_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """An upper bound on the memory one step's tensors take at once: `max_num_tokens` rows
    through a layer (hidden and residual, QKV and its rotated copies, the attention output, the
    gate/up projection and its product, each once more for the op producing the next) and the
    float32 logits of every row that samples (drafts included), with their softmax copies."""
    shape, limits = config.model, config.limits
    per_row = (4 * shape.hidden_size + 3 * (shape.q_size + 2 * shape.kv_size)
               + 3 * shape.intermediate_size)
    element = dtype.itemsize
    sampling_rows = limits.max_batch_size * (1 + config.speculative.num_draft_tokens)
    logits = 4 * sampling_rows * shape.vocab_size * 4
    return 2 * limits.max_num_tokens * per_row * element + logits


def free_memory_blocks(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                       fraction: float) -> int:
    """Blocks for `fraction` of the GPU memory free now (weights loaded), once a step's
    activations and the runtime's reserve are set aside. Raises ValueError naming the fraction
    when not even one sequence of max_seq_len tokens fits."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = step_activation_bytes(config, dtype) + GPU_RUNTIME_RESERVE_BYTES
    budget = int(max(0, free - reserve) * fraction)
    blocks = blocks_in(config, dtype, budget)
    tokens = blocks * config.kv_cache.tokens_per_block
    if tokens < config.limits.max_seq_len:
        raise ValueError(
            f"kv_cache_free_gpu_mem_fraction {fraction}: {free / 2**30:.2f} GiB of "
            f"{total / 2**30:.2f} GiB are free on {device} after loading, {reserve / 2**30:.2f} "
            f"GiB are kept for a step's activations, and the rest holds {tokens} tokens, fewer "
            f"than limits.max_seq_len ({config.limits.max_seq_len})")
    return blocks

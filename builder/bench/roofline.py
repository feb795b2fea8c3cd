"""The memory-bandwidth roofline of decoding: a decode step at concurrency 1 must read every
weight once, so tokens/s can be at most (read bandwidth) / (weight bytes per token).

The bandwidth is measured here, on this machine, with torch reading a buffer far larger than
the caches on the same threads the engine uses.
"""
from __future__ import annotations

import statistics
import time

import torch


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second that `sum` streams from memory (median of `repeats`)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    buffer.sum()  # fault every page in before timing
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        rates.append(num_bytes / (time.perf_counter() - start))
    del buffer
    return statistics.median(rates)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every projection (with its quantization scales),
    the norms and the LM head. The embedding table counts only when it is the LM head (tied, and
    no head of its own, such as a packed or int8 one, replaced it); a lookup reads one row. Tables of rotary angles read one row per token and are left out.
    A mixture of experts reads `num_experts_per_tok` of its experts a token: their share of the
    experts' bytes counts (the active parameters' roofline, the one a c=1 decode is held to)."""
    from triton_backend.engine.moe import SparseMoE

    # The embedding table is the LM head only while no LM head of its own replaced it (an int8
    # head quantized at load leaves the table for lookups alone).
    tied = getattr(model, "tie_word_embeddings", False) and getattr(model, "lm_head", None) is None
    active = {f"{name}.experts.": module.top_k / len(module.experts)
              for name, module in model.named_modules() if isinstance(module, SparseMoE)}
    total = 0.0
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" in name or ("vocab_embedding" in name and not tied):
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        share = next((s for prefix, s in active.items() if name.startswith(prefix)), 1.0)
        total += tensor.numel() * tensor.element_size() * share
    return int(total)

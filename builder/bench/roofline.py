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
    the norms and the LM head. The embedding table counts only when it is the LM head (tied);
    a lookup reads one row. Tables of rotary angles read one row per token and are left out."""
    tied = getattr(model, "tie_word_embeddings", False)
    total = 0
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" in name or ("vocab_embedding" in name and not tied):
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total

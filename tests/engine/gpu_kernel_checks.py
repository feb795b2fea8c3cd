"""The GPU backend's Triton kernels against their torch references, run by Triton's interpreter
on the CPU (TRITON_INTERPRET=1, set by the test that starts this script in a process of its own,
so no other test imports Triton). Prints one line per case; exits 1 on the first mismatch."""
from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter"

from triton_backend.engine.gpu.paged_attention import (  # noqa: E402
    paged_attention, paged_attention_reference)


def _case(seed: int, num_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int,
          chunks: list[tuple[int, int]], dtype: torch.dtype, kv: str = "auto",
          num_splits: int = 1) -> float:
    """chunks: (cached keys, new rows) per sequence. Returns the max |kernel - reference|."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // tokens_per_block) for c, n in chunks) + 1
    num_blocks = len(chunks) * max_blocks + 3
    slots = num_blocks * tokens_per_block
    if kv == "auto":
        k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=generator).to(dtype)
        v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=generator).to(dtype)
        k_scale = v_scale = 1.0
    else:
        k_cache = torch.randint(-100, 100, (slots, num_kv_heads, head_dim), generator=generator,
                                dtype=torch.int8)
        v_cache = torch.randint(-100, 100, (slots, num_kv_heads, head_dim), generator=generator,
                                dtype=torch.int8)
        if kv == "fp8":
            k_cache = (k_cache.float() / 30).to(torch.float8_e4m3fn)
            v_cache = (v_cache.float() / 30).to(torch.float8_e4m3fn)
        k_scale, v_scale = 0.03, 0.05
    # Blocks handed out shuffled, as a pool that has been used for a while hands them out.
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for b in range(len(chunks)):
        tables[b] = torch.tensor(order[b * max_blocks:(b + 1) * max_blocks], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    query_start = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1])
                                      for i in range(len(chunks))], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), num_heads, head_dim, generator=generator).to(dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, query_start, tokens_per_block, head_dim ** -0.5)
    expected = paged_attention_reference(*args, k_scale=k_scale, v_scale=v_scale)
    got = paged_attention(*args, max_query_len=max(n for _, n in chunks), k_scale=k_scale,
                          v_scale=v_scale, num_splits=num_splits)
    return float((got.float() - expected.float()).abs().max())


CASES = [
    # name, kwargs, tolerance
    ("decode gqa4 fp32", dict(num_heads=8, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                              chunks=[(5, 1), (17, 1), (0, 1), (40, 1)], dtype=torch.float32), 1e-5),
    ("decode gqa3 d64 fp32", dict(num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=16,
                                  chunks=[(33, 1), (1, 1)], dtype=torch.float32), 1e-5),
    ("prefill + prefix fp32", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                                   chunks=[(0, 13), (16, 7), (3, 40), (0, 1)],
                                   dtype=torch.float32), 1e-5),
    ("mha d80 fp32", dict(num_heads=2, num_kv_heads=2, head_dim=80, tokens_per_block=4,
                          chunks=[(9, 3), (0, 5)], dtype=torch.float32), 1e-5),
    ("splits fp32", dict(num_heads=8, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                         chunks=[(100, 1), (3, 1), (0, 1), (60, 4)], dtype=torch.float32,
                         num_splits=4), 1e-5),
    ("bf16", dict(num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
                  chunks=[(20, 1), (0, 9), (31, 2)], dtype=torch.bfloat16), 2e-2),
    ("int8 kv", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                     chunks=[(11, 1), (4, 6)], dtype=torch.float32, kv="int8"), 1e-5),
    ("fp8 kv", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                    chunks=[(11, 1), (4, 6)], dtype=torch.bfloat16, kv="fp8"), 2e-2),
]


def main() -> int:
    for seed, (name, kwargs, tolerance) in enumerate(CASES):
        diff = _case(seed, **kwargs)
        print(f"{name}: max |kernel - reference| {diff:.2e} (tolerance {tolerance:.0e})")
        if not diff <= tolerance:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

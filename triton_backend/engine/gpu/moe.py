"""A mixture of experts on the GPU: two grouped GEMMs over the (token, expert) pairs of a step,
sorted by expert, in place of a loop over experts.

The pairs are grouped on the device (no copy to the host, so a captured step can replay it):
each expert's run is padded to whole blocks of `BLOCK_M` slots, a padding slot holding the
sentinel `num_pairs`. One program computes one block of slots against one expert's weights:
the first GEMM reads each pair's token row and writes [pairs, 2 * intermediate] (gate; up), the
activation multiplies them, the second GEMM writes each pair's output scaled by its routing
weight, and the pairs of a token are summed. An expert no token chose owns no block: its weights
are never read.

Weights are stacked per layer, `gate_up` [E, 2I, H] and `proj` [E, H, I], as the runtime's
experts hold them (`moe.SparseMoE`; the backend stacks them once at load).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_backend.engine.gpu.triton_support import interpreted, tl, triton

BLOCK_M = 16


def stacked_experts(moe) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A SparseMoE's expert weights as [E, 2I, H] and [E, H, I], stacked once (each expert's
    weights then become views of the stack: no second copy); None when an expert's projections
    are not plain linears (quantized experts take the reference path)."""
    cached = getattr(moe, "_stacked", None)
    if cached is not None:
        return cached
    linears = [(e.gate_up, e.proj) for e in moe.experts]
    if any(type(m) is not torch.nn.Linear or m.bias is not None for pair in linears for m in pair):
        return None
    stacks = tuple(torch.stack([pair[i].weight for pair in linears]) for i in (0, 1))
    for j, pair in enumerate(linears):
        pair[0].weight.data, pair[1].weight.data = stacks[0][j], stacks[1][j]
    moe._stacked = stacks
    return stacks


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [S], each block's expert [S / block_m]) for pair ids t * top_k + j of
    `experts` [T, top_k]. S is the most slots any routing can need, so its shape depends only
    on T: padding slots hold the sentinel T * top_k; a block past the last expert's run holds
    only sentinels."""
    flat = experts.flatten()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    slots = starts[expert_of] + torch.arange(pairs, device=flat.device) - first_of_expert[expert_of]
    size = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[slots] = order
    block_starts = torch.arange(0, size, block_m, device=flat.device)
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp(max=num_experts - 1)
    return sorted_ids, block_expert


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, proj: torch.Tensor,
              weights: torch.Tensor, experts: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{experts[t, k]}(x[t]): x [T, H], gate_up
    [E, 2I, H], proj [E, H, I], weights / experts [T, top_k] -> [T, H] in x's dtype."""
    tokens, hidden = x.shape
    top_k, num_experts, width = experts.shape[1], gate_up.shape[0], gate_up.shape[1]
    sorted_ids, block_expert = align_by_expert(experts, num_experts)
    pairs = tokens * top_k
    inner = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, inner, sorted_ids, block_expert, pairs, top_k, None)
    gate, up = inner.chunk(2, dim=-1)
    act = F.silu(gate) if silu else F.gelu(gate, approximate="tanh")
    h = (act * up).contiguous()
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, proj, out, sorted_ids, block_expert, pairs, 1, weights.flatten())
    return out.view(tokens, top_k, hidden).sum(dim=1)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, pairs: int, rows_per_a: int,
                  scale: torch.Tensor | None) -> None:
    """c[p] = a[p // rows_per_a] @ b[expert of p]^T (* scale[p]) for every pair p."""
    n, k = b.shape[1], b.shape[2]
    block_n, block_k = min(64, triton.next_power_of_2(n)), min(64, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, sorted_ids, block_expert, scale if scale is not None else c, pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), ROWS_PER_A=rows_per_a,
        SCALED=scale is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=interpreted())


if triton is not None:
    @triton.jit
    def _grouped_gemm_kernel(A, B, C, SortedIds, BlockExpert, Scale, pairs, n, k, stride_a,
                             stride_be, stride_bn, stride_c, ROWS_PER_A: tl.constexpr,
                             SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
        block, col_block = tl.program_id(0), tl.program_id(1)
        slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SortedIds + slots)
        valid = pair < pairs
        if tl.max(valid.to(tl.int32), 0) == 0:  # padding past the last expert's run
            return
        expert = tl.load(BlockExpert + block)
        rows = tl.where(valid, pair // ROWS_PER_A, 0)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(A + rows[:, None] * stride_a + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < k), other=0.0)
            b = tl.load(B + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                        mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
            if FP32_DOT:  # the interpreter's 16-bit dot products are wrong: multiply in fp32
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc += tl.dot(a, b)
        if SCALED:
            acc = acc * tl.load(Scale + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        out = acc.to(C.dtype.element_ty)
        tl.store(C + tl.where(valid, pair, 0)[:, None] * stride_c + cols[None, :], out,
                 mask=valid[:, None] & (cols[None, :] < n))

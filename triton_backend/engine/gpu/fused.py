"""The decoder's small per-layer operations as one Triton kernel each: RMSNorm (with the residual
add), SiLU * up, and rotary + KV-cache write. Unfused, torch runs ~35 kernels a layer where these
take 4; in a CUDA graph each small kernel still costs a few microseconds of GPU time, more than
a decode step's GEMMs on a small model.

Each rounds where the torch reference (`ops.TorchOps`, transformers' modules) rounds: in a
16-bit dtype the norm is computed in float32, cast, then multiplied by the weight and cast again;
rotary rounds q * cos, rotate_half(q) * sin and their sum; SiLU rounds before the product. One
program per token row; `BLOCK` covers the row.
"""
from __future__ import annotations

import torch

from triton_backend.engine.gpu.triton_support import tl, triton


def _block(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x) * weight, residual + x); without a residual, (norm(x), x)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out,
                              new_residual, hidden, eps, x.stride(0),
                              HAS_RESIDUAL=residual is not None, BLOCK=_block(hidden))
    return out, new_residual


def silu_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """act(gate) * up of the fused [T, 2I] projection: SiLU, or with `gelu` GELU-tanh
    (Gemma's gate), the activation rounded to the dtype before the product as torch rounds."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    _gate_mul_kernel[(rows,)](gate_up, out, half, gate_up.stride(0), out.stride(0),
                              BLOCK=_block(half), GELU=gelu)
    return out


def rope_write_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     k_scale: float, v_scale: float, kv_kind: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at `positions`, write k and v to their cache slots (quantized for a
    one-byte cache: `kv_kind` 0 as is, 1 int8, 2 FP8); returns (q, k) rotated,
    [T, Hq, D] and [T, Hkv, D]."""
    rows = qkv.shape[0]
    q = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(rows, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_write_kernel[(rows, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q, k, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_BLOCK=_block(head_dim // 2), KV_KIND=kv_kind)
    return q, k


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(X, Residual, Weight, Out, NewResidual, hidden, eps, stride,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(X + row * stride + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(Residual + row * stride + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(NewResidual + row * stride + cols, x, mask=ok)
        h = x.to(tl.float32)
        variance = tl.sum(h * h, 0) / hidden
        h = (h * (1.0 / tl.sqrt(variance + eps))).to(X.dtype.element_ty)
        w = tl.load(Weight + cols, mask=ok, other=0.0)
        y = (w.to(tl.float32) * h.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + row * stride + cols, y, mask=ok)

    @triton.jit
    def _gate_mul_kernel(GateUp, Out, half, stride_in, stride_out, BLOCK: tl.constexpr,
                         GELU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(GateUp + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GateUp + row * stride_in + half + cols, mask=ok, other=0.0)
        if GELU:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (e^2z + 1)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        act = act.to(Out.dtype.element_ty)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_out + cols, y, mask=ok)

    @triton.jit
    def _rotate(x1, x2, c, s, dtype: tl.constexpr):
        """rotate_half's two halves, each product and the sum rounded to `dtype`."""
        o1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _rope_write_kernel(QKV, Positions, Cos, Sin, QOut, KOut, KCache, VCache, SlotMapping,
                           k_scale, v_scale, stride_qkv, stride_cos, stride_cs, stride_ch,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
                           KV_KIND: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)  # q heads, then kv heads
        half: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, HALF_BLOCK)
        ok = cols < half
        dtype = QOut.dtype.element_ty
        position = tl.load(Positions + row)
        c = tl.load(Cos + position * stride_cos + cols, mask=ok, other=0.0).to(dtype)
        s = tl.load(Sin + position * stride_cos + cols, mask=ok, other=0.0).to(dtype)
        c, s = c.to(tl.float32), s.to(tl.float32)
        base = QKV + row * stride_qkv + head * HEAD_DIM
        x1 = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + cols, mask=ok, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c, s, dtype)
        if head < NUM_HEADS:
            out = QOut + (row * NUM_HEADS + head) * HEAD_DIM
            tl.store(out + cols, o1, mask=ok)
            tl.store(out + half + cols, o2, mask=ok)
        else:
            kv_head = head - NUM_HEADS
            out = KOut + (row * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(out + cols, o1, mask=ok)
            tl.store(out + half + cols, o2, mask=ok)
            v_base = QKV + row * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            v1 = tl.load(v_base + cols, mask=ok, other=0.0)
            v2 = tl.load(v_base + half + cols, mask=ok, other=0.0)
            slot = tl.load(SlotMapping + row).to(tl.int64)
            offset = slot * stride_cs + kv_head * stride_ch
            _store_kv(KCache + offset, cols, ok, half, o1, o2, k_scale, KV_KIND)
            _store_kv(VCache + offset, cols, ok, half, v1, v2, v_scale, KV_KIND)

    @triton.jit
    def _round_half_even(x):
        """As torch.round: halves go to the even neighbour."""
        r = tl.floor(x + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)

    @triton.jit
    def _store_kv(ptr, cols, ok, half: tl.constexpr, a, b, scale, KV_KIND: tl.constexpr):
        if KV_KIND == 0:
            tl.store(ptr + cols, a.to(ptr.dtype.element_ty), mask=ok)
            tl.store(ptr + half + cols, b.to(ptr.dtype.element_ty), mask=ok)
        elif KV_KIND == 1:  # int8: rounded, clamped
            qa = _round_half_even(a.to(tl.float32) / scale)
            qb = _round_half_even(b.to(tl.float32) / scale)
            tl.store(ptr + cols, tl.minimum(tl.maximum(qa, -128.0), 127.0).to(tl.int8), mask=ok)
            tl.store(ptr + half + cols, tl.minimum(tl.maximum(qb, -128.0), 127.0).to(tl.int8),
                     mask=ok)
        else:  # FP8 e4m3, clamped to its largest finite value
            qa = tl.minimum(tl.maximum(a.to(tl.float32) / scale, -448.0), 448.0)
            qb = tl.minimum(tl.maximum(b.to(tl.float32) / scale, -448.0), 448.0)
            tl.store(ptr + cols, qa.to(tl.float8e4nv), mask=ok)
            tl.store(ptr + half + cols, qb.to(tl.float8e4nv), mask=ok)

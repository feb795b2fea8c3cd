"""FP8 activations in one kernel per projection.

An FP8 projection (`quant.linear.Fp8Linear` on `torch._scaled_mm`) quantizes its input with the
static per-tensor activation scale. In torch that is four kernels through float32 temporaries
(widen, divide, clamp, narrow) before the GEMM: on a 16-layer model ~192 launches a decode step,
which costs more than FP8 saves by reading half the weight bytes. Here it is one Triton kernel
reading the 16-bit activation once and writing the FP8 bytes, rounding exactly as the torch ops
do: the quotient in float32 with IEEE division, clamped to e4m3's largest finite value, rounded
to nearest even. The GPU backend installs it on every such projection at load
(`fuse_fp8_inputs`); the scale stays on the device, read by the kernel (nothing syncs).
"""
from __future__ import annotations

import torch

from triton_backend.engine.gpu.triton_support import tl, triton
from triton_backend.engine.gpu.variants import VARIANTS

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `Fp8Linear` computes unfused: [rows, K] -> float8_e4m3fn [rows, K]."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def block_size(n: int) -> int:
    return max(16, min(1024, 1 << max(0, n - 1).bit_length()))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One launch: x [rows, K] (any float dtype, rows contiguous), scale a float32 scalar tensor
    on x's device -> float8_e4m3fn [rows, K]."""
    rows, width = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    block = block_size(width)
    VARIANTS.note("quantize_fp8", str(x.dtype), block)
    _quantize_kernel[(rows, triton.cdiv(width, block))](x, scale, out, width, x.stride(0),
                                                        BLOCK=block)
    return out


def fuse_fp8_inputs(model: torch.nn.Module) -> int:
    """Give every projection on `_scaled_mm` the one-kernel input quantization; how many."""
    from triton_backend.engine.quant.linear import Fp8Linear

    fused = 0
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.kernel == "scaled_mm":
            module.quantize_input = quantize_fp8
            fused += 1
    return fused


if triton is not None:
    @triton.jit
    def _quantize_kernel(X, Scale, Out, width, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(X + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        scale = tl.load(Scale).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(Out + row * width + cols, q.to(tl.float8e4nv), mask=ok)

"""Symmetric group-wise INT4 weights in TensorRT-LLM's `W4A16_AWQ` checkpoint layout.

The checkpoint layout (what ModelOpt exports and `trtllm-build` reads) for a linear [out, in]:

- `weight`: int8 [out/2, in]; each byte holds two signed int4 values of *adjacent output rows*
  of the same input column: low nibble = even row 2r, high nibble = odd row 2r+1.
- `weights_scaling_factor`: float32 [out, in/group_size]; w = q * scale, q in [-8, 7].
- `prequant_scaling_factor`: [in]; the AWQ smoothing applied to the activations (x * s) before the
  matmul. Absent (or all ones) for round-to-nearest.
- `zero` (only with `quantization.zero_point`): float32 [out, in/group_size]; w = q * scale + zero.
  Asymmetric groups (the group's min and max map to q = -8 and 7), the grid GGUF's Q4_1 and
  GPTQ/AWQ-with-zeros use: a checkpoint that was stored on such a grid is reproduced, not re-rounded.

These helpers are pure tensor functions so the offline half (builder) and the runtime half share one
definition of the format; tests pin it against ModelOpt's own packer.
"""
from __future__ import annotations

import torch

INT4_MIN, INT4_MAX = -8, 7
TORCH_INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4pack matmul accepts


def check_group_size(in_features: int, group_size: int, name: str = "linear") -> None:
    """Raise a ValueError naming the layer when `group_size` does not divide its input size."""
    if group_size <= 0 or in_features % group_size != 0:
        raise ValueError(f"quantization.group_size {group_size} does not divide the input size "
                         f"{in_features} of {name}; pick a group size that divides it "
                         f"(e.g. {largest_dividing_group(in_features)})")


def largest_dividing_group(in_features: int) -> int:
    """The largest of the usual group sizes (128, 64, 32) that divides `in_features` (0: none)."""
    return next((g for g in (128, 64, 32) if in_features % g == 0), 0)


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: weight [out, in] -> (q int8 [out, in] in [-8, 7], scales f32 [out, in/g]).

    The scale is the group's absmax / 7, as ModelOpt computes it for `W4A16_AWQ`.
    """
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=-1) / INT4_MAX
    scales[scales == 0] = 1.0  # an all-zero group: any scale reproduces it
    q = (groups / scales[..., None]).round().clamp(INT4_MIN, INT4_MAX)
    return q.reshape(out_features, in_features).to(torch.int8), scales


def quantize_rtn_zero_point(weight: torch.Tensor, group_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest: weight [out, in] -> (q int8 [out, in] in [-8, 7], scales f32
    [out, in/g], zeros f32 [out, in/g]) with w ~ q * scale + zero; the group's min is q = -8."""
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / (INT4_MAX - INT4_MIN)
    scales[scales == 0] = 1.0  # a constant group: its zero alone reproduces it
    zeros = low - INT4_MIN * scales
    q = ((groups - zeros[..., None]) / scales[..., None]).round().clamp(INT4_MIN, INT4_MAX)
    return q.reshape(out_features, in_features).to(torch.int8), scales, zeros


def quantize_search_zero_point(weight: torch.Tensor, group_size: int,
                               importance: torch.Tensor | None = None, steps: int = 20,
                               rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_rtn_zero_point`'s format with each group's grid searched, not taken from its
    min and max: for `steps + 1` candidate scales around (max - min) / 15 the group is rounded,
    then its scale and zero are refit to those levels by least squares, weighted per input
    column by `importance` ([in], e.g. the calibration activations' mean square; None: equal);
    the group keeps the fit with the least weighted squared error, the min/max grid among the
    candidates (so a group that grid reproduces stays exact). llama.cpp's k-quant search."""
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    levels = INT4_MAX - INT4_MIN
    q_all, s_all, z_all = quantize_rtn_zero_point(weight, group_size)
    for start in range(0, out_features, rows):  # bounded temporaries on wide layers
        x = weight[start:start + rows].float().reshape(-1, in_features // group_size, group_size)
        w = (torch.ones_like(x) if importance is None else
             importance.float().reshape(1, -1, group_size).expand_as(x))
        low = x.amin(-1, keepdim=True)
        span = (x.amax(-1, keepdim=True) - low).clamp_min(torch.finfo(torch.float32).tiny)
        scale, zero = s_all[start:start + rows, :, None], z_all[start:start + rows, :, None]
        q = q_all[start:start + rows].float().reshape(x.shape)
        best = (w * (q * scale + zero - x) ** 2).sum(-1, keepdim=True)
        sum_w, sum_wx = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True)
        for step in range(steps + 1):
            inverse = (levels + (step - steps / 2) * 0.1) / span
            levels_q = ((x - low) * inverse).round().clamp(0, levels)
            sum_wq = (w * levels_q).sum(-1, keepdim=True)
            det = sum_w * (w * levels_q * levels_q).sum(-1, keepdim=True) - sum_wq * sum_wq
            fit = (sum_w * (w * levels_q * x).sum(-1, keepdim=True) - sum_wq * sum_wx) / det
            ok = (det > 0) & (fit > 0)
            fit = torch.where(ok, fit, scale)
            offset = (sum_wx - fit * sum_wq) / sum_w  # w = levels_q * fit + offset
            error = (w * (levels_q * fit + offset - x) ** 2).sum(-1, keepdim=True)
            better = ok & (error < best)
            best = torch.where(better, error, best)
            scale = torch.where(better, fit, scale)
            zero = torch.where(better, offset - INT4_MIN * fit, zero)  # q = levels_q + INT4_MIN
            q = torch.where(better, levels_q + INT4_MIN, q)
        q_all[start:start + rows] = q.reshape(-1, in_features).to(torch.int8)
        s_all[start:start + rows], z_all[start:start + rows] = scale[..., 0], zero[..., 0]
    return q_all, s_all, z_all


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    """q int8 [out, in] (unpacked), scales [out, in/g] and zeros (None: symmetric) -> weight
    [out, in] in `dtype`."""
    out_features, in_features = q.shape
    groups = scales.shape[1]
    w = q.float().reshape(out_features, groups, in_features // groups) * scales.float()[..., None]
    w = w.reshape(out_features, in_features)
    return (w if zeros is None else add_zeros(w, zeros)).to(dtype)


def add_zeros(dense: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """A dense [out, in] weight dequantized without its zeros, plus them (group-wise)."""
    out_features, in_features = dense.shape
    groups = zeros.shape[1]
    w = dense.reshape(out_features, groups, in_features // groups) + zeros.to(dense.dtype)[..., None]
    return w.reshape(out_features, in_features)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Unpacked int4 values int8 [out, in] -> the checkpoint's packed int8 [out/2, in]."""
    if q.shape[0] % 2:
        raise ValueError(f"INT4 packing needs an even number of output rows, got {q.shape[0]}")
    low = q[0::2].to(torch.int16) & 0x0F
    high = q[1::2].to(torch.int16) & 0x0F
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's packed int8 [out/2, in] -> int8 [out, in] with values in [-8, 7]."""
    raw = packed.view(torch.uint8).to(torch.int16)
    low, high = raw & 0x0F, raw >> 4
    # Sign-extend the 4-bit two's complement values.
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    out = torch.stack((low, high), dim=1)  # [out/2, 2, in]
    return out.reshape(-1, packed.shape[1]).to(torch.int8)

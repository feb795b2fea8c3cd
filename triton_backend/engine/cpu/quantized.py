"""The CPU backend's quantized projections: INT4 weights on the faster kernel of each shape,
and the int8 LM head.

At load a quantized layer keeps its 4-bit weights in the form every device multiplies by
(`quant/linear.py`); `pack_int4_linears` (the backend's `prepare`) repacks each for the kernel
`int4_kernel_choice` measured for its shape on this machine: ours
(`torch.ops.llm_forge.linear_int4_packed`: int8 activations quantized per block of 32 inputs,
integer dot products, scales and zeros as fp16) or torch's (`_weight_int4pack_mm_for_cpu`, bf16
activations), and from how many rows on a call dequantizes our layout for torch's dense GEMM
instead (with torch's kernel that layout is kept beside its own: 4 bits per weight more).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engine.cache_dir import cache_root
from triton_backend.engine.cpu.linear import (OthersCpuShare, PackedBf16Linear, best_times,
                                              cached_plan, keep_plan, upcast_threshold)
from triton_backend.engine.quant import int4
from triton_backend.engine.quant.linear import Int4WeightOnlyLinear

log = logging.getLogger(__name__)
DOT_PANEL = 32  # output columns per panel of the int8-activation kernels (four registers of 8)


def pack_int4_dot(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 q [N, K] (values in [-8, 7]), scales [N, K / group] and optional zeros (w = q * scale
    + zero) -> the INT4 kernel's layout (gemm_int4_dot.cpp): uint8 [ceil(N/32), K/8, 128], the
    stored nibbles u = q + 8 of column 8r + c for k = 8s + j (low) and 8s + 4 + j (high) in byte
    32r + 4c + j of step s; and fp16 [ceil(N/32), K / group, 64], per register r of 8 columns
    their 8 scales then their 8 offsets c = zero - 8 * scale (so that w = u * scale + c). K must
    be a multiple of 8."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"the INT4 kernel needs in_features divisible by 8, got {k}")
    panels = -(-n // DOT_PANEL)
    padded = panels * DOT_PANEL
    u = torch.zeros(padded, k, dtype=torch.uint8, device="cpu")  # padding columns: scale 0, offset 0
    u[:n] = (q.to(torch.int16) + 8).to(torch.uint8)
    u = u.view(panels, 4, 8, k // 8, 2, 4)  # [panel, register, column, step, half, j]
    packed = (u[..., 0, :] | (u[..., 1, :] << 4)).permute(0, 3, 1, 2, 4)  # [p, step, r, c, j]
    groups = scales.shape[1]
    scale = torch.zeros(padded, groups, dtype=torch.float32, device="cpu")
    scale[:n] = scales.float()
    offset = -8 * scale
    if zeros is not None:
        offset[:n] = zeros.float() - 8 * scales.float()
    params = torch.stack((scale.view(panels, 4, 8, groups),
                          offset.view(panels, 4, 8, groups)), dim=2)  # [p, r, 2, c, g]
    params = params.permute(0, 4, 1, 2, 3).reshape(panels, groups, 64)
    return packed.reshape(panels, k // 8, 128).contiguous(), params.to(torch.float16).contiguous()


def pack_int8_dot(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 per column and block of 32 inputs (q = round(w / s), s = max |w| / 127:
    llama.cpp's Q8_0) in the int8 kernel's layout: the values as uint8 [ceil(N/32), K/4, 128],
    column 8r + c's q for k = 4s + j in byte 32r + 4c + j of step s, and fp16 scales
    [ceil(N/32), K/32, 32]. K must be a multiple of 32."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"the int8 kernel needs in_features divisible by 32, got {k}")
    panels = -(-n // DOT_PANEL)
    padded = panels * DOT_PANEL
    blocks = weight.float().reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(-1) / 127).half()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.zeros(padded, k, dtype=torch.int8, device="cpu")
    q[:n] = (blocks / safe[..., None]).round().clamp(-127, 127).reshape(n, k).to(torch.int8)
    scales = torch.zeros(padded, k // 32, dtype=torch.float16, device="cpu")
    scales[:n] = scale
    packed = q.view(panels, 4, 8, k // 4, 4).permute(0, 3, 1, 2, 4)  # [p, step, r, c, j]
    packed = packed.reshape(panels, k // 4, 128).contiguous().view(torch.uint8)
    scales = scales.view(panels, DOT_PANEL, k // 32).permute(0, 2, 1).contiguous()
    return packed, scales


class Int8Head(nn.Module):
    """An LM head in int8 (`quantization.lm_head: int8`): the int8 kernel multiplies it by the
    hidden states quantized to int8 per block of 32, returning fp32 logits. The token embedding
    of a tied model keeps its bf16 table for lookups."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed, scales = pack_int8_dot(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_forge.linear_int8_packed(x, self.packed, self.scales,
                                                      self.out_features, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fp32(x).to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 [N, K] weight the kernel multiplies by (for tests and checks)."""
        panels, steps, _ = self.packed.shape
        q = self.packed.view(torch.int8).view(panels, steps, 4, 8, 4).permute(0, 2, 3, 1, 4)
        q = q.reshape(panels * DOT_PANEL, steps * 4)[:self.out_features].float()
        scales = self.scales.permute(0, 2, 1).reshape(-1, self.in_features // 32)
        return q * scales[:self.out_features].float().repeat_interleave(32, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_lm_head(model: nn.Module) -> bool:
    """Swap the model's LM head (or the projection of its tied embedding) for an `Int8Head`;
    False when the head is not a bf16/fp32 weight of a width the kernel takes."""
    head = model.lm_head
    if head is None:
        weight = model.transformer.vocab_embedding.weight
    elif isinstance(head, PackedBf16Linear):
        weight = head.weight_rows()
    elif type(head) is nn.Linear:
        weight = head.weight
    else:
        return False
    if weight.shape[1] % 32:
        return False
    model.lm_head = Int8Head(weight.detach())
    return True


@dataclass(frozen=True)
class Int4Choice:
    """For one INT4 weight shape: which kernel runs decode-sized calls ('cpp' ours, 'torch'
    torch's int4pack), from how many rows on the weights are dequantized for torch's dense GEMM
    instead (large prefills), and in which dtype bf16 activations meet them there
    (`upcast_dtype`: 'bfloat16' where torch's bf16 GEMM has the hardware for it and wins, else
    'float32')."""

    kernel: str
    upcast_min_rows: int | None = None
    upcast_dtype: str = "float32"


# Prefill row counts where dequantizing for torch's GEMM is timed against the INT4 kernel: a
# prompt of a hundred tokens already runs a GEMM that a 4-bit kernel does not make cheaper.
INT4_UPCAST_ROWS = (32, 64, 128, 256, 512, 1024)
INT4_PLAN_VERSION = 3  # plans measured by an older rule or kernel are measured again


def int4_kernel_choice(key: str, in_features: int, out_features: int, group_size: int
                       ) -> Int4Choice:
    """Our kernel wins at 1 and 16 tokens (decode batch sizes) or torch's does; measured once
    per machine, kernel build and shape, then read from the cache. Only the winner's layout is
    kept in memory."""
    path = cache_root() / "kernels" / key / "int4_plan.json"
    shape = f"{in_features}x{out_features}/g{group_size}"
    cached, entry = cached_plan(path, shape, INT4_PLAN_VERSION)
    if entry is not None:
        return Int4Choice(**entry["choice"])
    with OthersCpuShare() as busy:
        choice, torch_over_ours, upcast_over_kernel = _measure_int4(in_features, out_features,
                                                                    group_size)
    cached[shape] = {"choice": choice.__dict__, "others_cpu_share": busy.share,
                     "torch_over_ours_time": torch_over_ours,
                     "upcast_over_kernel_time": upcast_over_kernel, "version": INT4_PLAN_VERSION}
    keep_plan(path, cached)
    log.info("INT4 %s: %s", shape, choice)
    return choice


def _measure_int4(in_features: int, out_features: int, group_size: int
                  ) -> tuple[Int4Choice, list[float], dict[str, dict[int, float]]]:
    """(the choice, torch's time over ours at 1 and 16 rows, dequantizing's over the winner's
    at prefill sizes) for one shape, timed here and now."""
    q, scales = int4.quantize_rtn(torch.randn(out_features, in_features, device="cpu"), group_size)
    ours = pack_int4_dot(q, scales)
    theirs = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
    scale_t = scales.t().to(torch.bfloat16)
    zeros = torch.stack((scale_t, torch.zeros_like(scale_t)), dim=-1).contiguous()
    kernels = {
        "cpp": lambda x: torch.ops.llm_forge.linear_int4_packed(
            x, ours[0], ours[1], None, None, group_size, out_features),
        "torch": lambda x: torch._weight_int4pack_mm_for_cpu(x, theirs, group_size, zeros)}
    torch_over_ours = []
    for m in (1, 16) if group_size in int4.TORCH_INT4PACK_GROUP_SIZES else ():
        x = torch.randn(m, in_features, device="cpu").to(torch.bfloat16)
        t_ours, t_torch = best_times([lambda: kernels["cpp"](x), lambda: kernels["torch"](x)], 15)
        torch_over_ours.append(t_torch / t_ours)
    wins = not torch_over_ours or min(torch_over_ours) >= 1.0 or sum(torch_over_ours) >= 2.0
    winner = "cpp" if wins else "torch"
    # Large prefills: the winner against dequantizing (our layout) for torch's dense GEMM.
    dense = lambda: dequantize_int4(ours[0], ours[1], group_size, out_features)  # noqa: E731
    upcast_over_kernel: dict[str, dict[int, float]] = {"float32": {}, "bfloat16": {}}
    for m in INT4_UPCAST_ROWS:
        x = torch.randn(m, in_features, device="cpu").to(torch.bfloat16)
        t_kernel, t_fp32, t_bf16 = best_times([
            lambda: kernels[winner](x), lambda: F.linear(x.float(), dense()),
            lambda: F.linear(x, dense().to(torch.bfloat16))], 3)
        upcast_over_kernel["float32"][m] = t_fp32 / t_kernel
        upcast_over_kernel["bfloat16"][m] = t_bf16 / t_kernel
    # The dtype whose dequantize-and-GEMM is faster at the largest measured row count.
    largest = max(INT4_UPCAST_ROWS)
    dtype = min(upcast_over_kernel, key=lambda name: upcast_over_kernel[name][largest])
    choice = Int4Choice(winner, upcast_threshold(upcast_over_kernel[dtype]), dtype)
    return choice, torch_over_ours, upcast_over_kernel


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                    out_features: int) -> torch.Tensor:
    """The dense fp32 [out, in] weight of the INT4 kernel's packed layout (offsets included)."""
    return torch.ops.llm_forge.dequantize_int4_packed(packed, scales, group_size, out_features)


class CppInt4Linear(Int4WeightOnlyLinear):
    """An INT4 layer repacked for the kernel its shape's `Int4Choice` names: ours (`cpp_int4`),
    or torch's int4pack with our layout beside it when large prefills dequantize."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.upcast_min_rows: int | None = None  # rows from which a call dequantizes
        self.upcast_dtype = torch.float32  # what bf16 activations meet the dequantized weight in
        for buffer in ("tiles", "tile_scales"):  # our layout beside torch's int4pack
            self.register_buffer(buffer, None, persistent=False)

    @classmethod
    def repack(cls, linear: Int4WeightOnlyLinear, choice: Int4Choice) -> Int4WeightOnlyLinear:
        """`linear` (as loaded) for `choice`'s kernel; torch's int4pack alone in place."""
        if choice.kernel != "cpp" and choice.upcast_min_rows is None:
            linear.use_int4pack()
            return linear
        layer = cls(linear.in_features, linear.out_features, linear.has_bias, linear.group_size,
                    zero_point=linear.zero_point)
        layer.prequant, layer.bias, layer.zeros = linear.prequant, linear.bias, linear.zeros
        layer.packed_weight, layer.scales, layer.kernel = linear.packed_weight, linear.scales, "dequant"
        layer.upcast_min_rows, layer.upcast_dtype = choice.upcast_min_rows, getattr(torch, choice.upcast_dtype)
        tiles = pack_int4_dot(int4.unpack(linear.packed_weight), linear.scales, linear.zeros)
        if choice.kernel == "cpp" or not layer.use_int4pack():
            layer.packed_weight, layer.scales = tiles
            layer.zeros, layer.kernel = None, "cpp_int4"  # zeros folded into the packed offsets
        else:
            layer.tiles, layer.tile_scales = tiles
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kernel == "cpp_int4":
            return dequantize_int4(self.packed_weight, self.scales, self.group_size,
                                   self.out_features).to(dtype)
        if self.tiles is not None:
            return dequantize_int4(self.tiles, self.tile_scales, self.group_size,
                                   self.out_features).to(dtype)
        return super().dequantized_weight(dtype)

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.upcast_min_rows is not None and x2.shape[0] >= self.upcast_min_rows:
            # A large prefill: torch's GEMM on the weight dequantized for this call, in bf16
            # for bf16 activations where the plan measured that faster, else in fp32.
            if self.prequant is not None:
                x2 = x2 * self.prequant.to(x2.dtype)
            gemm_dtype = self.upcast_dtype if x2.dtype == torch.bfloat16 else torch.float32
            return F.linear(x2.to(gemm_dtype), self.dequantized_weight(gemm_dtype)).to(dtype)
        if self.kernel == "cpp_int4":
            # The AWQ scale is applied inside (rounded as torch would round it), then the rows
            # are quantized to int8 per block of 32 inputs.
            return torch.ops.llm_forge.linear_int4_packed(x2, self.packed_weight, self.scales,
                                                          self.prequant, None, self.group_size,
                                                          self.out_features).to(dtype)
        return super()._matmul(x2, dtype)


def int4_choice(key: str, linear: Int4WeightOnlyLinear) -> Int4Choice | None:
    """The measured choice for `linear`'s shape, or None where our kernel does not take it."""
    if linear.in_features % 8 or linear.group_size % 8:
        return None
    return int4_kernel_choice(key, linear.in_features, linear.out_features, linear.group_size)


def pack_int4_linears(model: nn.Module, key: str) -> int:
    """Repack every loaded CPU INT4 layer of `model` for its shape's kernel (torch's int4pack
    where ours does not take the shape); returns how many took ours or its layout."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not Int4WeightOnlyLinear or child.packed_weight is None \
                    or child.packed_weight.device.type != "cpu":
                continue
            choice = int4_choice(key, child)
            if choice is None:
                child.use_int4pack()
                continue
            layer = CppInt4Linear.repack(child, choice)
            if layer is not child:
                setattr(parent, name, layer)
                count += 1
    return count

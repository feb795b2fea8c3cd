"""Runtime quantized linears. They consume TensorRT-LLM checkpoint names and repack at load.

`Int4WeightOnlyLinear` (W4A16_AWQ): keys `weight` (packed int8 [out/2, in]),
`weights_scaling_factor` [out, in/g], `prequant_scaling_factor` [in], optional `bias`; with
`zero_point`, `zero` [out, in/g] (w = q * scale + zero, see int4.py). Loaded, it keeps the
4-bit weights and dequantizes them per call; the backend's `prepare` repacks them for a kernel:
torch's int4pack (`use_int4pack`, bf16 activations) on a CPU, or the CPU backend's own choice
per weight shape (`cpu/int4.py`: our int8-activation kernel or torch's, and from which prefill
size on a call dequantizes for torch's dense GEMM).

`Fp8Linear` (FP8): keys `weight` (float8_e4m3fn [out, in]), `weights_scaling_factor` ([1] or per
output row [out]), `activation_scaling_factor` [1], optional `bias`. On GPUs with FP8 tensor cores
(compute capability >= 8.9) it uses `torch._scaled_mm` with the static per-tensor activation scale,
as TensorRT-LLM's FP8 GEMM does (row-wise where the weight has a scale per output row); elsewhere
it dequantizes the weight per call (a CPU has no FP8 arithmetic: torch's CPU `_scaled_mm` is
emulated and measured slower than dequantizing).

Both replace their checkpoint tensors by the runtime form when loaded, so a loaded module's
`state_dict()` is not a checkpoint; nothing in the runtime saves one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engine.quant import int4

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def native_fp8_gemm(device: torch.device) -> bool:
    """True on CUDA GPUs with FP8 tensor cores (Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _take(state_dict: dict, prefix: str, name: str, missing: list[str]) -> torch.Tensor | None:
    key = prefix + name
    if key not in state_dict:
        missing.append(key)
        return None
    return state_dict[key]


def _check_shape(key: str, tensor: torch.Tensor, shape: tuple[int, ...], errors: list[str]) -> bool:
    if tuple(tensor.shape) != shape:
        errors.append(f"{key}: expected shape {shape}, got {tuple(tensor.shape)}")
        return False
    return True


class _QuantizedLinear(nn.Module):
    """What the quantized linears share: flatten the leading dims, matmul, add the bias."""

    in_features: int
    out_features: int

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, in_features] -> [tokens, out_features] in `dtype`, without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features), x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


class Int4WeightOnlyLinear(_QuantizedLinear):
    """y = (x * prequant_scale) @ dequant(W).T + b, with W INT4 per `group_size` group, symmetric
    or (`zero_point`) with a zero per group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 name: str = "linear", zero_point: bool = False) -> None:
        super().__init__()
        int4.check_group_size(in_features, group_size, name)
        if out_features % 2:
            raise ValueError(f"{name}: INT4 needs an even output size, got {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.has_bias, self.zero_point = bias, zero_point
        self.kernel = "unloaded"
        # Runtime tensors are non-persistent buffers: they follow .to() but are never saved.
        for buffer in ("packed_weight", "scales", "scales_and_zeros", "prequant", "bias", "zeros"):
            self.register_buffer(buffer, None, persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        out_f, in_f, groups = self.out_features, self.in_features, self.in_features // self.group_size
        packed = _take(state_dict, prefix, "weight", missing_keys)
        scales = _take(state_dict, prefix, "weights_scaling_factor", missing_keys)
        prequant = state_dict.get(prefix + "prequant_scaling_factor")
        bias = _take(state_dict, prefix, "bias", missing_keys) if self.has_bias else None
        zeros = _take(state_dict, prefix, "zero", missing_keys) if self.zero_point else None
        if packed is None or scales is None or (self.zero_point and zeros is None):
            return
        ok = _check_shape(prefix + "weight", packed, (out_f // 2, in_f), error_msgs)
        ok &= _check_shape(prefix + "weights_scaling_factor", scales, (out_f, groups), error_msgs)
        if zeros is not None:
            ok &= _check_shape(prefix + "zero", zeros, (out_f, groups), error_msgs)
        if prequant is not None:
            ok &= _check_shape(prefix + "prequant_scaling_factor", prequant, (in_f,), error_msgs)
        if ok:
            self.load_quantized(packed, scales, prequant, bias, zeros)

    def load_quantized(self, packed: torch.Tensor, scales: torch.Tensor,
                       prequant: torch.Tensor | None, bias: torch.Tensor | None,
                       zeros: torch.Tensor | None = None) -> None:
        """Take checkpoint tensors in the form every device multiplies by (dequantized per
        call); a backend's `prepare` repacks them for its kernels (`use_int4pack`, or the CPU
        backend's own)."""
        unit = prequant is None or bool((prequant == 1).all())
        self.prequant = None if unit else prequant  # round-to-nearest carries no smoothing
        self.bias = bias
        self.zeros = None if zeros is None else zeros.float()
        self.kernel = "dequant"
        self.packed_weight, self.scales = packed, scales.float()

    def use_int4pack(self) -> bool:
        """Repack a CPU layer for torch's int4pack kernel (bf16 activations); False where it
        does not take the shape (widths of 16, groups of 32..256)."""
        if (self.kernel != "dequant" or self.packed_weight.device.type != "cpu"
                or self.out_features % 16 or self.group_size not in int4.TORCH_INT4PACK_GROUP_SIZES
                or not hasattr(torch, "_weight_int4pack_mm_for_cpu")):
            return False
        # torch's kernel takes unsigned nibbles with w = (u - 8) * scale + zero: u = q + 8, zero 0.
        q = int4.unpack(self.packed_weight)
        try:
            packed = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
        except RuntimeError:
            return False
        scale_t = self.scales.t().to(torch.bfloat16)
        zero_t = torch.zeros_like(scale_t) if self.zeros is None else self.zeros.t().to(torch.bfloat16)
        self.scales_and_zeros = torch.stack((scale_t, zero_t), dim=-1).contiguous()
        self.packed_weight, self.kernel = packed, "cpu_int4pack"
        return True

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this module multiplies by, as a dense [out, in] tensor (for tests and checks)."""
        if self.kernel == "cpu_int4pack":
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            dense = torch._weight_int4pack_mm_for_cpu(eye, self.packed_weight, self.group_size,
                                                      self.scales_and_zeros)
            return dense.t().to(dtype)
        return int4.dequantize(int4.unpack(self.packed_weight), self.scales, dtype, self.zeros)

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.prequant is not None:
            x2 = x2 * self.prequant.to(x2.dtype)
        if self.kernel == "cpu_int4pack":
            return torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(),
                                                     self.packed_weight, self.group_size,
                                                     self.scales_and_zeros).to(dtype)
        return F.linear(x2, self.dequantized_weight(dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")


class Fp8Linear(_QuantizedLinear):
    """y = x @ (W_fp8 * weight_scale).T + b; activations quantized statically when `_scaled_mm` runs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, name: str = "linear") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.kernel = "unloaded"
        # (x [rows, in], activation scale) -> FP8 x: one fused kernel where a backend installs
        # it (gpu/fp8.py), else the torch ops.
        self.quantize_input = None
        for buffer in ("weight", "weight_scale", "activation_scale", "bias"):
            self.register_buffer(buffer, None, persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        weight = _take(state_dict, prefix, "weight", missing_keys)
        w_scale = _take(state_dict, prefix, "weights_scaling_factor", missing_keys)
        a_scale = _take(state_dict, prefix, "activation_scaling_factor", missing_keys)
        bias = _take(state_dict, prefix, "bias", missing_keys) if self.has_bias else None
        if weight is None or w_scale is None or a_scale is None:
            return
        ok = _check_shape(prefix + "weight", weight, (self.out_features, self.in_features), error_msgs)
        if w_scale.numel() not in (1, self.out_features):
            error_msgs.append(f"{prefix}weights_scaling_factor: expected 1 or {self.out_features} "
                              f"values, got shape {tuple(w_scale.shape)}")
            ok = False
        if weight.dtype != torch.float8_e4m3fn:
            error_msgs.append(f"{prefix}weight: expected float8_e4m3fn, got {weight.dtype}")
            ok = False
        if ok:
            self.load_quantized(weight, w_scale, a_scale, bias)

    def load_quantized(self, weight: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
                       bias: torch.Tensor | None, use_scaled_mm: bool | None = None) -> None:
        """Take checkpoint tensors. `use_scaled_mm` None: only where FP8 GEMMs are native."""
        self.weight = weight
        self.bias = bias
        self.weight_scale = w_scale.float().reshape(-1)
        self.activation_scale = a_scale.float().reshape(())
        if use_scaled_mm is None:
            use_scaled_mm = native_fp8_gemm(weight.device)
        self.kernel = "scaled_mm" if use_scaled_mm and self._scaled_mm_runs() else "dequant"

    def _scaled_mm_runs(self) -> bool:
        if not hasattr(torch, "_scaled_mm"):
            return False
        try:
            probe = torch.zeros(16, self.in_features, dtype=torch.float8_e4m3fn,
                                device=self.weight.device)
            self._scaled_mm(probe, torch.bfloat16)
        except (RuntimeError, NotImplementedError):
            return False
        return True

    def _scaled_mm(self, xq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_scale.numel() == 1:
            return torch._scaled_mm(xq, self.weight.t(), scale_a=self.activation_scale,
                                    scale_b=self.weight_scale.reshape(()), out_dtype=dtype)
        # A scale per output row: torch's row-wise scaling, the input's one scale on every row.
        return torch._scaled_mm(xq, self.weight.t(),
                                scale_a=self.activation_scale.expand(len(xq), 1).contiguous(),
                                scale_b=self.weight_scale[None, :], out_dtype=dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale if self.weight_scale.numel() == 1 else self.weight_scale[:, None]
        return (self.weight.float() * scale).to(dtype)

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel == "scaled_mm":
            if self.quantize_input is not None:
                xq = self.quantize_input(x2, self.activation_scale)
            else:
                xq = (x2.float() / self.activation_scale).clamp(-FP8_MAX, FP8_MAX).to(
                    torch.float8_e4m3fn)
            out_dtype = dtype if dtype != torch.float32 else torch.bfloat16
            return self._scaled_mm(xq, out_dtype).to(dtype)
        return F.linear(x2, self.dequantized_weight(dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"

"""The runtime half of quantization: modules and caches that consume the quantizer's output.

The offline half (`builder.quantize`) writes weights in TensorRT-LLM checkpoint names; the
modules here load exactly those names and repack them for this machine's kernels. The mode comes
from the engine config (`quantization.weights`, `kv_cache.dtype`), never from file names.
"""
from __future__ import annotations

from torch import nn

from triton_backend.engine.config import QuantConfig
from triton_backend.engine.quant.kv_cache import (QuantizedPagedKVCache, make_quantized_kv_cache,
                                                  quantized_kv_bytes_per_token)
from triton_backend.engine.quant.linear import Fp8Linear, Int4WeightOnlyLinear

INT4_MODES = ("int4_awq", "int4_rtn")
WEIGHT_MODES = ("none",) + INT4_MODES + ("fp8",)
KV_CACHE_MODES = ("none", "fp8", "int8")
LM_HEAD_MODES = ("none", "int8")  # int8: per column and block of 32 inputs, int8 activations

__all__ = ["Fp8Linear", "Int4WeightOnlyLinear", "QuantizedPagedKVCache", "make_quantized_linear",
           "make_quantized_kv_cache", "quantized_kv_bytes_per_token", "WEIGHT_MODES",
           "KV_CACHE_MODES", "LM_HEAD_MODES"]


def make_quantized_linear(in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                          name: str) -> nn.Module:
    """The linear factory's hook for `quant.weights` != 'none' (exclusions already applied)."""
    if quant.weights in INT4_MODES:
        return Int4WeightOnlyLinear(in_features, out_features, bias, quant.group_size, name,
                                    zero_point=quant.zero_point)
    if quant.weights == "fp8":
        return Fp8Linear(in_features, out_features, bias, name)
    raise ValueError(f"quantization.weights must be one of {WEIGHT_MODES}, got {quant.weights!r}")

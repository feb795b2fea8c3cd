"""FP8 / INT8 paged KV cache with per-layer key and value scales from calibration.

Stored value = K / k_scale (FP8 e4m3: clamped to +-448; INT8: rounded, clamped to [-128, 127]);
read back as stored * k_scale. One byte per element, so the same memory budget holds twice the
tokens of a 16-bit cache. The scales are TensorRT-LLM's `k_cache_scaling_factor` /
`v_cache_scaling_factor` of each layer (amax / 448 for FP8, clamped to >= 1 as ModelOpt exports
it; amax / 127 for INT8); the engine's config.json carries them under
`extra.quantization.kv_cache_scales` so the cache can be built without reading the weights.
"""
from __future__ import annotations

import torch

from triton_backend.engine.config import EngineConfig, ModelShape
from triton_backend.engine.kv_cache import PagedKVCache

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# FP8 is kept in a uint8 container: CPU index_copy_ has no float8 kernel; views are free.
KV_STORAGE_DTYPES = {"fp8": torch.uint8, "int8": torch.int8}
FP8_MAX = 448.0


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float, kv_dtype: str) -> torch.Tensor:
    """x (any float dtype) -> the one-byte storage of `kv_dtype` ('fp8' or 'int8')."""
    y = x.float() / scale
    if kv_dtype == "fp8":
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if kv_dtype == "int8":
        return y.round().clamp(-128, 127).to(torch.int8)
    raise ValueError(f"kv_cache.dtype must be fp8 or int8, got {kv_dtype!r}")


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype
                  ) -> torch.Tensor:
    """The inverse of `quantize_kv`, in `dtype`."""
    return (stored.to(torch.float32) * scale).to(dtype)


def kv_cache_scales(config: EngineConfig) -> tuple[list[float], list[float]]:
    """Per-layer (k_scales, v_scales) recorded by the quantizer; a ValueError names what is missing."""
    scales = config.extra.get("quantization", {}).get("kv_cache_scales")
    layers = config.model.num_hidden_layers
    if not scales or len(scales.get("k", [])) != layers or len(scales.get("v", [])) != layers:
        raise ValueError(f"kv_cache.dtype {config.kv_cache.dtype!r} needs "
                         f"extra.quantization.kv_cache_scales with {layers} k and v values in the "
                         f"engine config; rebuild the engine with a calibrated KV cache")
    return [float(s) for s in scales["k"]], [float(s) for s in scales["v"]]


class QuantizedPagedKVCache(PagedKVCache):
    """A `PagedKVCache` storing one byte per element, with a key and a value scale per layer."""

    def __init__(self, shape: ModelShape, num_blocks: int, tokens_per_block: int, kv_dtype: str,
                 k_scales: list[float], v_scales: list[float],
                 device: torch.device | str = "cpu") -> None:
        super().__init__(shape, num_blocks, tokens_per_block, KV_STORAGE_DTYPES[kv_dtype], device)
        self.kv_dtype = kv_dtype
        self.k_scales = torch.tensor(k_scales, dtype=torch.float32, device=device)
        self.v_scales = torch.tensor(v_scales, dtype=torch.float32, device=device)
        # The scales as the kernels take them: rounded to fp32 first, as `write` divides by them.
        self._scales = torch.stack([self.k_scales, self.v_scales]).cpu().contiguous()
        self._layer_scales = list(zip(self.k_scales.tolist(), self.v_scales.tolist()))

    def kernel_reads(self, dtype: torch.dtype) -> bool:
        """The C++ kernels quantize on write and widen on read, for any activation dtype."""
        return self.k.device.type == "cpu"

    def layer_scales(self, layer: int) -> tuple[float, float]:
        return self._layer_scales[layer]

    def kernel_scales(self) -> torch.Tensor:
        return self._scales

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        storage = self.k.dtype
        self.k[layer].index_copy_(0, slot_mapping,
                                  quantize_kv(k, self.k_scales[layer], self.kv_dtype).view(storage))
        self.v[layer].index_copy_(0, slot_mapping,
                                  quantize_kv(v, self.v_scales[layer], self.kv_dtype).view(storage))

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        values = KV_DTYPES[self.kv_dtype]
        return (dequantize_kv(self.k[layer][slots].view(values), self.k_scales[layer], dtype),
                dequantize_kv(self.v[layer][slots].view(values), self.v_scales[layer], dtype))


def make_quantized_kv_cache(config: EngineConfig, num_blocks: int,
                            device: torch.device | str = "cpu") -> QuantizedPagedKVCache:
    """The model runner's hook: the cache for `config.kv_cache.dtype` ('fp8' or 'int8')."""
    k_scales, v_scales = kv_cache_scales(config)
    return QuantizedPagedKVCache(config.model, num_blocks, config.kv_cache.tokens_per_block,
                                 config.kv_cache.dtype, k_scales, v_scales, device)


def quantized_kv_bytes_per_token(config: EngineConfig) -> int:
    """KV bytes one token occupies across all layers in the one-byte cache (the block manager's unit)."""
    return PagedKVCache.bytes_per_token(config.model, KV_STORAGE_DTYPES[config.kv_cache.dtype])

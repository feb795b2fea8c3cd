"""What one quantization run gives the builder, whichever quantizer ran (ModelOpt's in
`quantizer`, ours in `zero_point`): the config sections and the measured weight sizes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from triton_backend.engine.config import EngineConfig, QuantConfig

_QUANT_SUFFIXES = ("weights_scaling_factor", "prequant_scaling_factor", "activation_scaling_factor",
                   "zero")


@dataclass
class QuantizationResult:
    """What the builder records: the config sections and the measured weight sizes."""

    quantization: QuantConfig
    kv_cache_dtype: str                      # EngineConfig.kv_cache.dtype: auto | fp8 | int8
    extra: dict = field(default_factory=dict)  # EngineConfig.extra["quantization"]
    quantized_linear_bytes: int = 0           # quantized linears' weights + scales, as stored
    quantized_linear_bf16_bytes: int = 0      # the same linears at 16 bits

    @property
    def linear_size_ratio(self) -> float | None:
        if not self.quantized_linear_bf16_bytes:
            return None
        return self.quantized_linear_bytes / self.quantized_linear_bf16_bytes

    def apply(self, config: EngineConfig) -> None:
        """Record this result in an engine config (the single source of truth for the runtime)."""
        config.quantization = self.quantization
        config.kv_cache.dtype = self.kv_cache_dtype
        config.extra["quantization"] = self.extra


def linear_bytes(state: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(stored bytes, 16-bit bytes) of the quantized linears in a runtime/TRT-LLM state dict."""
    modules = {key.rsplit(".", 1)[0] for key in state if key.endswith(".weights_scaling_factor")}
    stored = bf16 = 0
    for module in modules:
        weight = state[f"{module}.weight"]
        # INT4 packs two rows per byte; its scales keep one row per output channel.
        rows = (state[f"{module}.weights_scaling_factor"].shape[0] if weight.dtype == torch.int8
                else weight.shape[0])
        bf16 += rows * weight.shape[1] * 2
        stored += weight.numel() * weight.element_size()
        stored += sum(state[f"{module}.{s}"].numel() * state[f"{module}.{s}"].element_size()
                      for s in _QUANT_SUFFIXES if f"{module}.{s}" in state)
    return stored, bf16

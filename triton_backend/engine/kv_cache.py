"""The paged KV cache storage: one flat slot array per layer, addressed by slot ids.

Slot `s` of the cache holds the key/value of one token: slot = block_id * tokens_per_block + offset.
The block manager decides which blocks a sequence owns; this class only stores and gathers.
Quantized caches (fp8/int8) subclass it and override `write`/`gather` and `bytes_per_token`.
"""
from __future__ import annotations

import torch

from triton_backend.engine.config import ModelShape


class PagedKVCache:
    def __init__(self, shape: ModelShape, num_blocks: int, tokens_per_block: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        num_slots = num_blocks * tokens_per_block
        dims = (shape.num_hidden_layers, num_slots, shape.num_key_value_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        element = dtype.itemsize
        return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * element

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def kernel_reads(self, dtype: torch.dtype) -> bool:
        """Whether the C++ kernels read this cache in place for activations of `dtype`."""
        return self.k.dtype == dtype

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """The (key, value) scales the kernels read a layer's stored elements with."""
        return 1.0, 1.0

    def kernel_scales(self) -> torch.Tensor | None:
        """Every layer's scales for the one-call decode step: [2, layers] fp32, or None."""
        return None

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` (any shape S) -> [*S, Hkv, D] each, in `dtype`."""
        return self.k[layer][slots].to(dtype), self.v[layer][slots].to(dtype)

"""Building blocks of the Llama-family model: RMSNorm, rotary embedding, and the linear factory.

Every projection of the model is created by `make_linear`, so quantized linears (which consume the
same weight names plus their scales) plug in at one place.
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine.config import ModelShape, QuantConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (the arithmetic lives in the ops backend). With `residual` it first
    adds `x` to it and returns (normed, new residual), the fused form the decoder layers use."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def make_linear(in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                name: str) -> nn.Module:
    """The one place projections are created. `name` is the weight prefix (for exclude lists)."""
    if quant.weights != "none" and not any(m in name for m in quant.exclude_modules):
        from triton_backend.engine.quant import make_quantized_linear  # optional runtime half

        return make_quantized_linear(in_features, out_features, bias, quant, name)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.weight.requires_grad_(False)
    if bias:
        linear.bias.requires_grad_(False)
    return linear


def _rope_inv_freq(shape: ModelShape) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, exactly as transformers computes them (on the
    CPU, so every device starts from the same tables)."""
    params = dict(shape.rope_scaling or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        dim = shape.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        return 1.0 / (shape.rope_theta ** exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("model.rope_scaling: rope_type 'dynamic' is not supported by the runtime")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params.update(rope_type=rope_type, rope_theta=shape.rope_theta)
    hf_config = LlamaConfig(hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                            head_dim=shape.head_dim,
                            max_position_embeddings=shape.max_position_embeddings,
                            rope_parameters=params)
    with torch.device("cpu"):  # its helpers make tensors of their own without naming a device
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, gathered per token by position;
    computed in float32 on the CPU, then moved to `device`."""

    def __init__(self, shape: ModelShape, max_positions: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(shape)
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] at their positions [T]."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

"""Building blocks of the decoder: RMSNorm, rotary embedding, the gated MLP, and the linear factory.

Every projection of the model is created by `make_linear`, so quantized linears (which consume the
same weight names plus their scales) plug in at one place.
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine.config import EngineConfig, ModelShape, QuantConfig
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.ops import TorchOps


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


class GatedMLP(nn.Module):
    """proj(act(gate) * up), act SiLU or GELU-tanh (`model.hidden_act`). `prefix` and
    `intermediate_size` default to the layer's own MLP (an expert passes its own)."""

    def __init__(self, config: EngineConfig, layer: int, prefix: str | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        shape, quant = config.model, config.quantization
        prefix = prefix or f"transformer.layers.{layer}.mlp"
        size = intermediate_size or shape.intermediate_size
        self.layer = layer
        self.silu = shape.hidden_act == "silu"
        self.gate_up = make_linear(shape.hidden_size, 2 * size, shape.mlp_bias, quant,
                                   f"{prefix}.gate_up")
        self.proj = make_linear(size, shape.hidden_size, shape.mlp_bias, quant, f"{prefix}.proj")

    def forward(self, x: torch.Tensor, ops: TorchOps, lora: LoRABatch | None = None
                ) -> torch.Tensor:
        act = ops.silu_mul if self.silu else ops.gelu_tanh_mul
        if lora is None:
            return self.proj(act(self.gate_up(x)))
        h = act(lora.apply(self.layer, "gate_up", x, self.gate_up(x)))
        return lora.apply(self.layer, "proj", h, self.proj(h))



def _rope_inv_freq(shape: ModelShape, theta: float | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, exactly as transformers computes them (on the
    CPU, so every device starts from the same tables). `theta`: a local layers' own base, which
    rotates without scaling (Gemma 3)."""
    params = dict(shape.rope_scaling or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default" or theta is not None:
        dim = shape.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        return 1.0 / ((theta or shape.rope_theta) ** exponents), 1.0
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
                 device: torch.device | str = "cpu", theta: float | None = None) -> None:
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(shape, theta)
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

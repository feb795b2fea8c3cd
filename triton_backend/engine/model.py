"""The Llama-family decoder (Llama GQA/MHA, Mistral, Qwen2 with QKV bias) over packed tokens.

Weight names follow TensorRT-LLM's checkpoint layout, with the gate/up projections fused:
`transformer.vocab_embedding.weight`, `transformer.layers.{i}.input_layernorm.weight`,
`.attention.qkv.weight` (+ `.bias`), `.attention.dense.weight`, `.post_layernorm.weight`,
`.mlp.gate_up.weight` ([gate; up] along the output dim), `.mlp.proj.weight`,
`transformer.ln_f.weight`, `lm_head.weight` (absent when the embeddings are tied).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engine.attention import AttentionMetadata, paged_attention
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.layers import RMSNorm, RotaryEmbedding, make_linear


class Attention(nn.Module):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__()
        shape, quant = config.model, config.quantization
        prefix = f"transformer.layers.{layer}.attention"
        self.layer = layer
        self.num_heads, self.num_kv_heads = shape.num_attention_heads, shape.num_key_value_heads
        self.head_dim = shape.head_dim
        self.q_size, self.kv_size = shape.q_size, shape.kv_size
        self.scale = shape.head_dim ** -0.5
        self.qkv = make_linear(shape.hidden_size, self.q_size + 2 * self.kv_size,
                               shape.attention_bias, quant, f"{prefix}.qkv")
        self.dense = make_linear(self.q_size, shape.hidden_size, False, quant, f"{prefix}.dense")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        o = paged_attention(self.layer, q, k, v, cache, meta, self.scale)
        return self.dense(o.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__()
        shape, quant = config.model, config.quantization
        prefix = f"transformer.layers.{layer}.mlp"
        self.intermediate_size = shape.intermediate_size
        self.gate_up = make_linear(shape.hidden_size, 2 * shape.intermediate_size, shape.mlp_bias,
                                   quant, f"{prefix}.gate_up")
        self.proj = make_linear(shape.intermediate_size, shape.hidden_size, shape.mlp_bias, quant,
                                f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__()
        shape = config.model
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.attention = Attention(config, layer)
        self.post_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = GatedMLP(config, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), positions, rotary, cache, meta)
        return x + self.mlp(self.post_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        shape = config.model
        self.vocab_embedding = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.vocab_embedding.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(shape.num_hidden_layers))
        self.ln_f = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(packed ids, positions, cache, metadata) -> hidden states; `logits` projects rows."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        shape = config.model
        self.config = config
        self.transformer = Transformer(config)
        self.rotary = RotaryEmbedding(shape, config.limits.max_seq_len)
        self.tie_word_embeddings = shape.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.transformer.vocab_embedding(input_ids)
        for layer in self.transformer.layers:
            x = layer(x, positions, self.rotary, cache, meta)
        return self.transformer.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.transformer.vocab_embedding.weight if self.tie_word_embeddings
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()

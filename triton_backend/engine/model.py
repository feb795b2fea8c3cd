"""The Llama-family decoder over packed tokens; families (`engine/families/`) build it, swapping in
their own attention module where they differ (e.g. Qwen3's QK-norm).

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

from triton_backend.engine.attention import AttentionMetadata
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.layers import GatedMLP, RMSNorm, RotaryEmbedding, make_linear
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.moe import SparseMoE
from triton_backend.engine.ops import TorchOps
from triton_backend.engine.progress import Progress


class Attention(nn.Module):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__()
        shape, quant = config.model, config.quantization
        prefix = f"transformer.layers.{layer}.attention"
        self.layer = layer
        self.num_heads, self.num_kv_heads = shape.num_attention_heads, shape.num_key_value_heads
        self.head_dim = shape.head_dim
        self.q_size, self.kv_size = shape.q_size, shape.kv_size
        self.scale = shape.attention_scale or shape.head_dim ** -0.5
        self.window = shape.window_of(layer)  # None: attends every key
        self.qkv = make_linear(shape.hidden_size, self.q_size + 2 * self.kv_size,
                               shape.attention_bias, quant, f"{prefix}.qkv")
        self.dense = make_linear(self.q_size, shape.hidden_size, False, quant, f"{prefix}.dense")

    def project_qkv(self, x: torch.Tensor, ops: TorchOps, lora: LoRABatch | None) -> torch.Tensor:
        """[T, q_size + 2 kv_size] before the rotary embedding (a family's hook)."""
        qkv = self.qkv(x)
        if lora is not None:
            lora.apply(self.layer, "qkv", x, qkv)
        return qkv

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: PagedKVCache, meta: AttentionMetadata, ops: TorchOps,
                lora: LoRABatch | None = None) -> torch.Tensor:
        qkv = self.project_qkv(x, ops, lora)
        o = ops.attention(self.layer, qkv, positions, rotary, cache, meta, self.num_heads,
                          self.num_kv_heads, self.head_dim, self.scale, self.window)
        out = self.dense(o)
        return out if lora is None else lora.apply(self.layer, "dense", o, out)


def first_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, ops: TorchOps
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's first norm: (normed input, residual stream), the previous block's output `x`
    added into the stream first (the first block's input is the stream itself)."""
    if residual is None:
        return norm(x, ops), x
    return norm(x, ops, residual)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden state so each RMSNorm can
    take the residual add with it (one fused op instead of add + norm)."""

    def __init__(self, config: EngineConfig, layer: int, attention: type[Attention] = Attention
                 ) -> None:
        super().__init__()
        shape = config.model
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.attention = attention(config, layer)
        self.post_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = SparseMoE(config, layer) if shape.is_moe_layer(layer) else GatedMLP(config, layer)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: PagedKVCache, meta: AttentionMetadata,
                ops: TorchOps, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream without it); the next norm adds them."""
        h, residual = first_norm(self.input_layernorm, x, residual, ops)
        h = self.attention(h, positions, rotary, cache, meta, ops, lora)
        h, residual = self.post_layernorm(h, ops, residual)
        return self.mlp(h, ops, lora), residual


class Transformer(nn.Module):
    def __init__(self, config: EngineConfig, attention: type[Attention] = Attention,
                 layer: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        shape = config.model
        self.vocab_embedding = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.vocab_embedding.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layer(config, i, attention)
                                    for i in range(shape.num_hidden_layers))
        self.ln_f = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(packed ids, positions, cache, metadata, ops) -> hidden states; `logits` projects
    rows. `lm_head` is None while the embeddings are tied (the projection reads the embedding
    table) unless a kernel gave it a layout of its own (`cpu.linear.pack_linears`).
    `progress` advances after every decoder layer, so a long prefill shows the engine's watchdog
    that it moves (the runner shares its engine's counter here)."""

    # Multiplies the embeddings (Gemma: sqrt(hidden_size), rounded to the weights' dtype).
    embedding_multiplier: float | None = None

    def __init__(self, config: EngineConfig, attention: type[Attention] = Attention,
                 layer: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        shape = config.model
        self.config = config
        self.transformer = Transformer(config, attention, layer)
        self.rotary = RotaryEmbedding(shape, config.limits.max_seq_len)
        # Local layers may rotate with a base of their own (Gemma 3: 10k local, 1M global).
        self.rotary_local = self.rotary if shape.rope_local_theta is None else RotaryEmbedding(
            shape, config.limits.max_seq_len, theta=shape.rope_local_theta)
        self.tie_word_embeddings = shape.tie_word_embeddings
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
        self.progress = Progress()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: AttentionMetadata, ops: TorchOps, lora: LoRABatch | None = None
                ) -> torch.Tensor:
        """`lora`: the step's adapters and the rows each applies to (None: base model only)."""
        x = self.transformer.vocab_embedding(input_ids)
        if self.embedding_multiplier is not None:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype, device=x.device)
        residual = None
        for layer in self.transformer.layers:
            rotary = self.rotary if layer.attention.window is None else self.rotary_local
            x, residual = layer(x, residual, positions, rotary, cache, meta, ops, lora)
            self.progress.tick()
        if residual is None:  # a model without layers
            return self.transformer.ln_f(x, ops)
        return self.transformer.ln_f(x, ops, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.transformer.vocab_embedding.weight).float()
        fp32_logits = getattr(self.lm_head, "forward_fp32", None)  # packed heads keep fp32 sums
        return fp32_logits(hidden) if fp32_logits else self.lm_head(hidden).float()

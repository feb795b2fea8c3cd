"""Gemma 3 (text): the Qwen3 attention (QK-norm) over local and global layers, and its own block.

What differs from Llama, and where it lives:
- local (sliding-window) layers interleaved with global ones by `layer_types`, each kind with its
  own rotary base (`rope_local_theta` 10k, `rope_theta` 1M): ModelShape, the model's per-layer
  rotary and the attention's `window`;
- RMSNorm scaled by (1 + w): the converter stores 1 + w, so every norm is the plain one;
- four norms a block: before and after the attention, before and after the MLP
  (`Gemma3DecoderLayer`);
- a GELU-tanh gate (`hidden_activation`), embeddings times sqrt(hidden_size) rounded to the
  weights' dtype, the softmax scaled by `query_pre_attn_scalar` ** -0.5;
- tied embeddings over a 262,144-token vocabulary.

`gemma3` checkpoints (the multimodal Gemma3ForConditionalGeneration) are read as their text model:
`text_config` and the language model's weights; the vision tower is not served.
Runtime names follow TensorRT-LLM's Gemma checkpoint: `post_layernorm` after the attention,
`pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine.attention import AttentionMetadata
from triton_backend.engine.config import EngineConfig, ModelShape
from triton_backend.engine.families.llama import LlamaFamily, Weight
from triton_backend.engine.families.qwen3 import QKNormAttention
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.layers import GatedMLP, RMSNorm, RotaryEmbedding
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.model import CausalLM, first_norm
from triton_backend.engine.ops import TorchOps

# Where a multimodal checkpoint keeps the text model (transformers 5, then 4.x).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


class Gemma3DecoderLayer(nn.Module):
    """Norms on both sides of the attention and of the MLP. As in the Llama layer, the residual
    stream travels beside the output so the next block's first norm takes the add."""

    def __init__(self, config: EngineConfig, layer: int, attention: type[nn.Module]) -> None:
        super().__init__()
        size, eps = config.model.hidden_size, config.model.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.attention = attention(config, layer)
        self.post_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GatedMLP(config, layer)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: PagedKVCache, meta: AttentionMetadata,
                ops: TorchOps, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = first_norm(self.input_layernorm, x, residual, ops)
        h = self.post_layernorm(self.attention(h, positions, rotary, cache, meta, ops, lora), ops)
        h, residual = self.pre_feedforward_layernorm(h, ops, residual)
        return self.post_feedforward_layernorm(self.mlp(h, ops, lora), ops), residual


class Gemma3CausalLM(CausalLM):
    def __init__(self, config: EngineConfig, attention: type[nn.Module] = QKNormAttention
                 ) -> None:
        super().__init__(config, attention, Gemma3DecoderLayer)
        self.embedding_multiplier = config.model.hidden_size ** 0.5


class Gemma3Family(LlamaFamily):
    layer_weights = (
        Weight("input_layernorm", ("input_layernorm",)),
        Weight("attention.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "attention_bias"),
        Weight("attention.q_layernorm", ("self_attn.q_norm",)),
        Weight("attention.k_layernorm", ("self_attn.k_norm",)),
        Weight("attention.dense", ("self_attn.o_proj",)),
        Weight("post_layernorm", ("post_attention_layernorm",)),
        Weight("pre_feedforward_layernorm", ("pre_feedforward_layernorm",)),
        Weight("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"), "mlp_bias"),
        Weight("mlp.proj", ("mlp.down_proj",), "mlp_bias"),
        Weight("post_feedforward_layernorm", ("post_feedforward_layernorm",)),
    )

    def shape_fields(self, hf_config: dict) -> dict:
        hf_config = hf_config.get("text_config") or hf_config
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf_config.get(name) is not None:  # Gemma 2's; Gemma 3 has none
                raise ValueError(f"checkpoint: {name}={hf_config[name]} is not supported")
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("checkpoint: use_bidirectional_attention (an embedding model) is "
                             "not supported: the engine generates causally")
        fields = super().shape_fields({**hf_config,
                                       "hidden_act": hf_config.get("hidden_activation",
                                                                   "gelu_pytorch_tanh")})
        local = (hf_config.get("rope_parameters") or {}).get("sliding_attention") or {}
        fields["rope_local_theta"] = float(local.get("rope_theta",
                                                     hf_config.get("rope_local_base_freq", 10000.0)))
        scalar = hf_config.get("query_pre_attn_scalar")
        fields["attention_scale"] = None if scalar is None else float(scalar) ** -0.5
        fields["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", True))
        return fields

    def _attention_layers(self, hf_config: dict) -> tuple[list[str] | None, int | None]:
        if hf_config.get("layer_types") is None and hf_config.get("sliding_window_pattern"):
            pattern = hf_config["sliding_window_pattern"]  # 4.x configs: every pattern-th global
            hf_config = {**hf_config, "layer_types": [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(hf_config["num_hidden_layers"])]}
        return super()._attention_layers(hf_config)

    def convert_state_dict(self, hf_state: dict[str, torch.Tensor], shape: ModelShape,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        text = {}
        for name, tensor in hf_state.items():
            prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                name = "model." + name[len(prefix):]
            elif name.startswith(_NOT_TEXT):
                continue
            if name.endswith("norm.weight"):  # Gemma scales by (1 + w): stored as the sum
                tensor = tensor.float() + 1.0
            text[name] = tensor
        return super().convert_state_dict(text, shape, dtype)

    def build(self, config: EngineConfig) -> nn.Module:
        return Gemma3CausalLM(config)


GEMMA3 = Gemma3Family("gemma3", ("gemma3_text", "gemma3"), example=dict(
    num_hidden_layers=3, num_key_value_heads=1, sliding_window=24, query_pre_attn_scalar=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}))
FAMILIES = (GEMMA3,)

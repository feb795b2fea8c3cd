"""Qwen3 (dense): the Llama layout plus an RMSNorm over each head of q and of k before the rotary
embedding (QK-norm), and no QKV bias.

Runtime names of the two norms follow TensorRT-LLM's Qwen3 checkpoint:
`transformer.layers.{i}.attention.q_layernorm.weight` / `.k_layernorm.weight` ([head_dim]).
The C++ one-call decode path (`cpu/forward.py`) norms the heads as `qk_norm` does.
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.layers import RMSNorm
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.model import Attention
from triton_backend.engine.families.llama import LlamaFamily, Weight
from triton_backend.engine.ops import TorchOps


class QKNormAttention(Attention):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__(config, layer)
        shape = config.model
        self.q_layernorm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_layernorm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor, ops: TorchOps, lora: LoRABatch | None) -> torch.Tensor:
        qkv = super().project_qkv(x, ops, lora)
        return ops.qk_norm(qkv, self.q_layernorm.weight, self.k_layernorm.weight, self.num_heads,
                           self.num_kv_heads, self.q_layernorm.eps)


class Qwen3Family(LlamaFamily):
    layer_weights = LlamaFamily.layer_weights + (
        Weight("attention.q_layernorm", ("self_attn.q_norm",)),
        Weight("attention.k_layernorm", ("self_attn.k_norm",)),
    )

    def attention_class(self) -> type[nn.Module]:
        return QKNormAttention


QWEN3 = Qwen3Family("qwen3", ("qwen3",), example=dict(num_key_value_heads=2))
FAMILIES = (QWEN3,)

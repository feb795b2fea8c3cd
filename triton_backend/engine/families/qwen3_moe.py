"""Qwen3-MoE: Qwen3's attention (QK-norm) and a mixture of experts in place of the MLP, with no
shared expert. `norm_topk_prob` says whether the kept routing weights are renormalised; layers in
`mlp_only_layers`, or off the `decoder_sparse_step` beat, keep a dense MLP of `intermediate_size`.
"""
from __future__ import annotations

from triton_backend.engine.families._moe_layout import MoELayout
from triton_backend.engine.families.qwen3 import Qwen3Family


class Qwen3MoeFamily(MoELayout, Qwen3Family):
    def shape_fields(self, hf_config: dict) -> dict:
        fields = super().shape_fields(hf_config)
        fields.update(self.routing_fields(hf_config))
        step = hf_config.get("decoder_sparse_step") or 1
        dense = set(hf_config.get("mlp_only_layers") or [])
        dense |= {i for i in range(fields["num_hidden_layers"]) if (i + 1) % step}
        fields["dense_layers"] = sorted(dense)
        fields["norm_topk_prob"] = bool(hf_config.get("norm_topk_prob", False))
        return fields


QWEN3_MOE = Qwen3MoeFamily("qwen3_moe", ("qwen3_moe",), example=dict(
    num_hidden_layers=3, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]))
FAMILIES = (QWEN3_MOE,)

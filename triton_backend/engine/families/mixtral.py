"""Mixtral: the Llama layer with a mixture of experts in place of the MLP (`block_sparse_moe`:
experts w1 = gate, w3 = up, w2 = down); the kept routing weights always renormalised. Its
`sliding_window`, when set, makes every layer local (Mistral's rule)."""
from __future__ import annotations

from triton_backend.engine.families.llama import LlamaFamily
from triton_backend.engine.families._moe_layout import MoELayout


class MixtralFamily(MoELayout, LlamaFamily):
    router = "block_sparse_moe.gate"
    experts = "block_sparse_moe.experts"
    expert_names = ("w1", "w3", "w2")

    def shape_fields(self, hf_config: dict) -> dict:
        fields = super().shape_fields(hf_config)
        fields.update(self.routing_fields(hf_config), norm_topk_prob=True)
        return fields


MIXTRAL = MixtralFamily("mixtral", ("mixtral",), sliding_window_by_default=True,
                        example=dict(num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, intermediate_size=48))
FAMILIES = (MIXTRAL,)

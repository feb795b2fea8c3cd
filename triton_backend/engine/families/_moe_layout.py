"""What every mixture-of-experts family shares: its experts' weight table and routing fields.

A family mixes `MoELayout` in before its dense base (`class Mixtral(MoELayout, LlamaFamily)`) and
names where its checkpoint keeps the router and the experts; the runtime module is
`engine/moe.py`'s `SparseMoE`, built for every layer `ModelShape.is_moe_layer` names.
"""
from __future__ import annotations

import re

from triton_backend.engine.config import ModelShape
from triton_backend.engine.families.llama import PROJECTIONS, Weight


class MoELayout:
    router: str = "mlp.gate"              # under model.layers.{i}.
    experts: str = "mlp.experts"          # expert j's projections: {experts}.{j}.{name}
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    layer_weights: tuple[Weight, ...]

    def routing_fields(self, hf_config: dict) -> dict:
        """ModelShape's expert fields; `num_experts` or Mixtral's `num_local_experts`."""
        num_experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
        if not num_experts:
            raise ValueError("checkpoint: config.json names no num_experts / num_local_experts")
        return dict(num_experts=num_experts,
                    num_experts_per_tok=hf_config.get("num_experts_per_tok"),
                    moe_intermediate_size=hf_config.get("moe_intermediate_size")
                    or hf_config.get("intermediate_size"))

    def layer_weights_of(self, shape: ModelShape, layer: int) -> tuple[Weight, ...]:
        if not shape.is_moe_layer(layer):
            return self.layer_weights
        gate, up, down = self.expert_names
        own = tuple(w for w in self.layer_weights if not w.runtime.startswith("mlp."))
        experts = tuple(
            weight for j in range(shape.num_experts) for weight in (
                Weight(f"mlp.experts.{j}.gate_up", (f"{self.experts}.{j}.{gate}",
                                                    f"{self.experts}.{j}.{up}"), "mlp_bias"),
                Weight(f"mlp.experts.{j}.proj", (f"{self.experts}.{j}.{down}",), "mlp_bias")))
        return own + (Weight("mlp.router", (self.router,)),) + experts

    def runtime_name(self, hf_module: str) -> str | None:
        """An expert's projection, `model.layers.3.mlp.experts.5.up_proj` ->
        `transformer.layers.3.mlp.experts.5.gate_up`; else the dense table's name."""
        gate, up, down = self.expert_names
        match = re.fullmatch(rf"model\.layers\.(\d+)\.{re.escape(self.experts)}\.(\d+)\.(\w+)",
                             hf_module)
        if match is None:
            return super().runtime_name(hf_module)  # type: ignore[misc]
        layer, expert, name = match.groups()
        part = {gate: "gate_up", up: "gate_up", down: "proj"}.get(name)
        return None if part is None else f"transformer.layers.{layer}.mlp.experts.{expert}.{part}"

    def lora_parts(self) -> list[tuple[str, str, str, int]]:
        """The attention's projections only: adapters on experts are not served."""
        return [(*hf.split("."), weight.runtime, index) for weight in self.layer_weights
                if weight.runtime in PROJECTIONS and weight.runtime.startswith("attention.")
                for index, hf in enumerate(weight.hf)]

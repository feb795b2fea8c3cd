"""A mixture-of-experts MLP over packed tokens (Qwen3-MoE, Mixtral).

A router scores every expert for each token; the `num_experts_per_tok` best are kept, their
softmax weights renormalised to sum to one where the family says so (`model.norm_topk_prob`),
and each token's output is the weighted sum of its experts' gated MLPs. Tokens are grouped by
expert with one sort, so each active expert runs its projections once per step over all of its
rows (through whichever linear the projection is: our packed bf16 GEMM, INT4, FP8), and an
expert no token chose reads none of its weights: at one token per step, a decode reads only
the routed experts' bytes.

Weights follow TensorRT-LLM's per-layer names: `mlp.router.weight` [num_experts, hidden] and
one gated MLP per expert, `mlp.experts.{j}.gate_up` / `.proj` (see `families/_moe_layout.py` for
the HF names each family reads).
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.layers import GatedMLP
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.ops import TorchOps


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k]): softmax in fp32, the
    top_k kept, renormalised when asked, as transformers computes it."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoE(nn.Module):
    def __init__(self, config: EngineConfig, layer: int) -> None:
        super().__init__()
        shape = config.model
        prefix = f"transformer.layers.{layer}.mlp"
        self.layer = layer
        self.top_k, self.renormalise = shape.num_experts_per_tok, shape.norm_topk_prob
        # The router stays in the activations' dtype, never quantized (TensorRT-LLM's too):
        # which experts run must not move with the weights' rounding.
        self.router = nn.Linear(shape.hidden_size, shape.num_experts, bias=False)
        self.router.weight.requires_grad_(False)
        self.experts = nn.ModuleList(
            GatedMLP(config, layer, f"{prefix}.experts.{j}", shape.moe_intermediate_size)
            for j in range(shape.num_experts))

    def forward(self, x: torch.Tensor, ops: TorchOps, lora: LoRABatch | None = None
                ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: the backend's (`ops.sparse_moe`). `lora` is never given:
        adapters on experts are refused at build time."""
        return ops.sparse_moe(self, x)

    def grouped(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """The reference: tokens grouped by expert, each active expert run once."""
        weights, experts = route(self.router(x), self.top_k, self.renormalise)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows_of, weight_of = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):  # ascending ids, as transformers adds
            if count:
                rows = rows_of[start:start + count]
                y = expert(x[rows], ops) * weight_of[start:start + count, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return out

"""The mixture-of-experts MLP on the CPU kernels: every active expert of a step in one call.

`prepare_moe(model)` (at load, after the projections are packed) stacks each `SparseMoE` layer's
expert weights in one packed layout: `pairs` (AVX-512 BF16 dot products) for a bf16 engine where
this build of the kernels has them, else bf16 `tiles`; an fp32 engine keeps its fp32 weights in
tiles. A bf16 layer's expert projections become views of the stacks (the weights held once);
`SparseMoE.grouped`, the reference, still runs them. `sparse_moe(moe, x)` routes in torch (the
router's GEMM, softmax, top-k, renormalisation: `moe.route`, as the reference) and runs the experts' MLPs and the weighted sum in
`torch.ops.llm_forge.moe_experts` (csrc/moe.cpp), which reads each routed expert's weights once a
step and none of an expert no row chose. The one-call decode path (`forward.py`, csrc/forward.cpp)
routes the same way in C++ (the same ops, in order) and calls the same kernel.

Covered: bf16 or fp32 experts with a SiLU gate, no biases, an intermediate size divisible by 16.
Anything else (INT4 or FP8 experts, GELU, biases) keeps the per-expert path: `covers` says which.
Each row is computed the same way whatever the step's row count (csrc/moe.cpp), so n choices of
one request equal single requests. There is no row-count switch: a prefill's experts run on the
fused kernel too (its register tiles, not AMX; on a Xeon with AMX torch's GEMM over plain
per-expert weights prefilled 1,024 rows faster, which the weights held once rule out).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triton_backend.engine.cpu.linear import PackedBf16Linear
from triton_backend.engine.moe import SparseMoE, route

TILE = 16


@dataclass(frozen=True)
class PackedExperts:
    """Every expert of one layer: gate_up [E, tiles, ...] and down [E, tiles, ...] in `layout`."""

    gate_up: torch.Tensor
    down: torch.Tensor
    intermediate: int
    layout: str  # "tiles" or "pairs"

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the rows the kernel multiplies (the pairs kernel: bf16 only)."""
        return torch.float32 if self.gate_up.dtype == torch.float32 else torch.bfloat16


def pack_tiles(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, K] -> tiles of 16 output columns in the weight's own dtype: `tiles` [ceil(N / 16), K,
    16] or `pairs` [ceil(N / 16), K / 2, 16, 2] (cpu/linear.py's `pack_weight` layouts)."""
    n, k = weight.shape
    padded = -(-n // TILE) * TILE
    rows = torch.zeros(padded, k, dtype=weight.dtype, device="cpu")
    rows[:n] = weight
    if layout == "pairs":
        return rows.view(padded // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return rows.view(padded // TILE, TILE, k).permute(0, 2, 1).contiguous()


def _dense_weight(linear: nn.Module) -> torch.Tensor | None:
    """The [out, in] weight of an unquantized projection without bias, else None."""
    if getattr(linear, "bias", None) is not None:
        return None
    if type(linear) is nn.Linear:
        return linear.weight.detach()
    weight_rows = getattr(linear, "weight_rows", None)  # a PackedBf16Linear
    return weight_rows().contiguous() if callable(weight_rows) else None


def pack_experts(moe: SparseMoE, layout: str) -> PackedExperts | None:
    """One layer's experts stacked in `layout`, or None where the kernel does not cover them."""
    intermediate = moe.experts[0].proj.in_features
    if intermediate % TILE or not all(expert.silu for expert in moe.experts):
        return None
    gate_ups, downs = [], []
    for expert in moe.experts:
        gate_up, down = _dense_weight(expert.gate_up), _dense_weight(expert.proj)
        if gate_up is None or down is None or gate_up.dtype not in (torch.bfloat16, torch.float32):
            return None
        gate_ups.append(gate_up)
        downs.append(down.to(gate_up.dtype))
    dtype = gate_ups[0].dtype
    if dtype == torch.float32 or any(w.shape[1] % 2 for w in (gate_ups[0], downs[0])):
        layout = "tiles"
    return PackedExperts(torch.stack([pack_tiles(w, layout) for w in gate_ups]),
                         torch.stack([pack_tiles(w, layout) for w in downs]), intermediate, layout)


def share_weights(moe: SparseMoE, packed: PackedExperts) -> None:
    """Point a bf16 layer's expert projections at the stacks (`PackedBf16Linear` views of each
    expert's slice), so the experts' weights are held once; the per-expert path then runs the
    packed GEMM of the same layout. fp32 stacks are not shared (their experts keep their own
    weights)."""
    if packed.gate_up.dtype != torch.bfloat16:
        return
    for j, expert in enumerate(moe.experts):
        for name, stack in (("gate_up", packed.gate_up), ("proj", packed.down)):
            linear = getattr(expert, name)
            shared = PackedBf16Linear(_dense_weight(linear), None, layout=packed.layout)
            shared.packed = stack[j]
            setattr(expert, name, shared)


def default_layout() -> str:
    """pairs where this build of the kernels has bf16 dot products, else tiles."""
    return "pairs" if torch.ops.llm_forge.moe_pairs_available() else "tiles"


def prepare_moe(model: nn.Module, layout: str | None = None) -> int:
    """Stack every `SparseMoE` layer's experts for the fused kernel (`moe.packed_experts`);
    returns how many layers it covers. Load the CPU kernels first."""
    layout = layout or default_layout()
    count = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.packed_experts = pack_experts(module, layout)
            if module.packed_experts is not None:
                share_weights(module, module.packed_experts)
                count += 1
    return count


def covers(moe: SparseMoE, x: torch.Tensor) -> bool:
    """True when `sparse_moe` computes this layer for these rows (prepared, the kernel's dtype)."""
    packed = getattr(moe, "packed_experts", None)
    return packed is not None and x.dtype == packed.activation_dtype and x.device.type == "cpu"


def sparse_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """[T, hidden] -> [T, hidden], as `moe.grouped` computes it, in one kernel call (see
    `covers`)."""
    packed = moe.packed_experts
    weights, experts = route(moe.router(x), moe.top_k, moe.renormalise)
    return torch.ops.llm_forge.moe_experts(x.contiguous(), experts.contiguous(),
                                           weights.contiguous(), packed.gate_up, packed.down,
                                           packed.intermediate)

"""Our writer of a TensorRT-LLM 1.2 checkpoint for the families ModelOpt's exporter refuses
(Gemma 3, Mixtral, Qwen3-MoE: families.OWN_WRITER), from the runtime-layout state dict that
`families.get(arch).convert_state_dict` makes (qkv fused q|k|v, gate_up fused gate|up, Gemma's
norms already stored as 1 + w).

    trtllm_checkpoint/config.json         families.checkpoint_config (one for all ranks)
    trtllm_checkpoint/rank{N}.safetensors N = pp_rank * tp + tp_rank

Per rank, under `transformer.` (what NVIDIA/TensorRT-LLM's converters write:
`tensorrt_llm/models/gemma/convert.py` load_gemma_weights, `models/llama/convert.py` and
`models/qwen/convert.py` for the experts):
- `vocab_embedding.weight` [V, H] on the first pp rank; split over tp (rows) for Gemma 3 when
  tp > 1, else whole. `lm_head.weight` [V_padded / tp, H] on the last pp rank (the tied
  embedding copied in when the checkpoint ties it; V padded with zero rows to a multiple of tp).
  `ln_f.weight` on the last pp rank.
- `layers.{i}.attention.qkv.weight` [(q + 2 kv) heads / tp * head_size, H]: this rank's q heads,
  then its k and v heads (KV heads replicated when tp exceeds them: rank r holds kv head
  r * kv // tp); `attention.dense.weight` [H, q heads / tp * head_size] (split on columns);
  `attention.{q,k}_layernorm.weight` [head_size] whole (Gemma 3, Qwen3-MoE).
- Norms `input_layernorm`, `post_layernorm` (after the attention for Gemma 3, before the MLP
  otherwise), Gemma 3's `pre_feedforward_layernorm` / `post_feedforward_layernorm`: whole.
- Dense MLP (Gemma 3): `mlp.fc.weight` = gate_proj, `mlp.gate.weight` = up_proj, both
  [I / tp, H]; `mlp.proj.weight` [H, I / tp].
- Experts: `mlp.router.weight` [E, H] float32, whole; `mlp.fc.weight` [E / moe_ep, 2 I / moe_tp, H]
  = this rank's experts, each [up; gate] (up first: TensorRT-LLM stacks w3 then w1 and its
  swiglu gates with the second half); `mlp.proj.weight` [E / moe_ep, H, I / moe_tp].
Layers split over pp like `Mapping.pp_layers` (torch.tensor_split: the first ranks one more).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from builder.trtllm.families import checkpoint_config
from triton_backend.engine.config import ModelShape

CONFIG_FILE = "config.json"


def mapping_of(tp: int, pp: int, moe_split: tuple[int, int] | None) -> dict:
    mapping = {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    if moe_split is not None:
        mapping["moe_tp_size"], mapping["moe_ep_size"] = moe_split
    return mapping


def pp_layers(num_layers: int, pp: int, pp_rank: int) -> list[int]:
    return [int(i) for i in torch.tensor_split(torch.arange(num_layers), pp)[pp_rank]]


def write_checkpoint(state: dict[str, torch.Tensor], shape: ModelShape, dtype: str, out_dir: Path,
                     tp: int, pp: int, moe_split: tuple[int, int] | None = None) -> dict:
    """Write the checkpoint of `state` (runtime layout) split into tp * pp ranks; returns the
    config. `moe_split` (moe_tp, moe_ep) is required for a model with experts."""
    mapping = mapping_of(tp, pp, moe_split if shape.num_experts else None)
    config = checkpoint_config(shape, dtype, mapping)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    torch_dtype = getattr(torch, dtype)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            tensors = rank_tensors(state, shape, mapping, tp_rank, pp_rank)
            tensors = {name: t.to(torch.float32 if name.endswith("mlp.router.weight")
                                  else torch_dtype).contiguous() for name, t in tensors.items()}
            save_file(tensors, str(out_dir / f"rank{pp_rank * tp + tp_rank}.safetensors"))
    return config


def rank_tensors(state: dict[str, torch.Tensor], shape: ModelShape, mapping: dict, tp_rank: int,
                 pp_rank: int) -> dict[str, torch.Tensor]:
    """The tensors one rank holds, in the state's dtype (the router cast when saved)."""
    tp, pp = mapping["tp_size"], mapping["pp_size"]
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        embedding = state["transformer.vocab_embedding.weight"]
        if shape.architecture == "gemma3" and tp > 1:
            embedding = embedding.chunk(tp, dim=0)[tp_rank]
        out["transformer.vocab_embedding.weight"] = embedding
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = state["transformer.ln_f.weight"]
        head = state.get("lm_head.weight", state["transformer.vocab_embedding.weight"])
        out["lm_head.weight"] = _pad_rows(head, tp).chunk(tp, dim=0)[tp_rank]
    for layer in pp_layers(shape.num_hidden_layers, pp, pp_rank):
        prefix = f"transformer.layers.{layer}."
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        out.update({prefix + k: v for k, v in _layer(own, shape, mapping, tp_rank).items()})
    return out


def _layer(own: dict[str, torch.Tensor], shape: ModelShape, mapping: dict,
           tp_rank: int) -> dict[str, torch.Tensor]:
    tp = mapping["tp_size"]
    out = {name: tensor for name, tensor in own.items() if name.endswith("layernorm.weight")}
    out["attention.qkv.weight"] = _qkv_rows(own["attention.qkv.weight"], shape, tp, tp_rank)
    out["attention.dense.weight"] = own["attention.dense.weight"].chunk(tp, dim=1)[tp_rank]
    if shape.num_experts:
        out.update(_experts(own, shape, mapping, tp_rank))
    else:
        gate, up = own["mlp.gate_up.weight"].chunk(2, dim=0)
        out["mlp.fc.weight"] = gate.chunk(tp, dim=0)[tp_rank]
        out["mlp.gate.weight"] = up.chunk(tp, dim=0)[tp_rank]
        out["mlp.proj.weight"] = own["mlp.proj.weight"].chunk(tp, dim=1)[tp_rank]
    return out


def _qkv_rows(qkv: torch.Tensor, shape: ModelShape, tp: int, tp_rank: int) -> torch.Tensor:
    d, heads, kv = shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads
    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=0)
    q = q.chunk(tp, dim=0)[tp_rank]
    if kv >= tp:
        k, v = k.chunk(tp, dim=0)[tp_rank], v.chunk(tp, dim=0)[tp_rank]
    else:  # fewer KV heads than ranks: each rank keeps the one its q heads read
        head = tp_rank * kv // tp
        k, v = k[head * d:(head + 1) * d], v[head * d:(head + 1) * d]
    return torch.cat([q, k, v], dim=0)


def _experts(own: dict[str, torch.Tensor], shape: ModelShape, mapping: dict,
             tp_rank: int) -> dict[str, torch.Tensor]:
    moe_tp, moe_ep = mapping["moe_tp_size"], mapping["moe_ep_size"]
    moe_tp_rank, moe_ep_rank = tp_rank // moe_ep, tp_rank % moe_ep
    per_rank = shape.num_experts // moe_ep
    fc, proj = [], []
    for expert in range(moe_ep_rank * per_rank, (moe_ep_rank + 1) * per_rank):
        gate, up = own[f"mlp.experts.{expert}.gate_up.weight"].chunk(2, dim=0)
        fc.append(torch.cat([up.chunk(moe_tp, dim=0)[moe_tp_rank],
                             gate.chunk(moe_tp, dim=0)[moe_tp_rank]], dim=0))
        proj.append(own[f"mlp.experts.{expert}.proj.weight"].chunk(moe_tp, dim=1)[moe_tp_rank])
    return {"mlp.router.weight": own["mlp.router.weight"], "mlp.fc.weight": torch.stack(fc),
            "mlp.proj.weight": torch.stack(proj)}


def _pad_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    missing = -weight.shape[0] % multiple
    if not missing:
        return weight
    return torch.cat([weight, weight.new_zeros(missing, weight.shape[1])], dim=0)

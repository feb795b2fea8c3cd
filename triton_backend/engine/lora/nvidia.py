"""NVIDIA's LoRA request tensors (tensorrtllm_backend's `lora_weights` / `lora_config`).

`lora_config` is [N, 3] (a leading batch dimension of 1 is accepted): one row per module and
layer, [module_id, layer_idx, adapter_size]. `lora_weights` is [N, D * Hi + Ho * D]: the row's
in-weights (A, [D, Hi]) and out-weights (B, [Ho, D], scaling already folded in, as NVIDIA's
`hf_lora_convert.py` writes them) flattened and concatenated, zero-padded to the longest row.
Module ids follow TensorRT-LLM's `LoraModule` for Llama: 0 attn_qkv, 1 attn_q, 2 attn_k,
3 attn_v, 4 attn_dense, 5 mlp_h_to_4h (HF gate_proj), 6 mlp_4h_to_h (down_proj), 7 mlp_gate
(up_proj).
"""
from __future__ import annotations

import numpy as np
import torch

from triton_backend.engine.config import ModelShape
from triton_backend.engine.lora.layout import (AdapterError, Contribution, Projections,
                                               check_pair, hf_contribution, hf_part, runtime_dims)

MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
              "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7}
HF_TO_NVIDIA = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
                "gate_proj": "mlp_h_to_4h", "down_proj": "mlp_4h_to_h", "up_proj": "mlp_gate"}
NVIDIA_TO_HF = {v: k for k, v in HF_TO_NVIDIA.items()}
_NAMES = {v: k for k, v in MODULE_IDS.items()}


def _squeeze_batch(name: str, array: np.ndarray, dims: int) -> np.ndarray:
    if array.ndim == dims + 1 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != dims:
        raise AdapterError(f"{name}: expected {dims} dimensions (a batch dimension of 1 "
                           f"allowed), got shape {tuple(array.shape)}")
    return array


def contributions_from_nvidia(weights: np.ndarray, config: np.ndarray, shape: ModelShape,
                              names: Projections, max_rank: int, task_id: int) -> list[Contribution]:
    """Parse and check NVIDIA's tensors against the base model."""
    weights = _squeeze_batch("lora_weights", np.asarray(weights), 2)
    config = _squeeze_batch("lora_config", np.asarray(config), 2)
    if config.shape[1] != 3 or config.shape[0] != weights.shape[0] or config.shape[0] == 0:
        raise AdapterError(f"lora_config: expected [N, 3] rows matching lora_weights' "
                           f"{weights.shape[0]} rows, got shape {tuple(config.shape)}")
    rows = torch.from_numpy(weights.astype(np.float32, copy=False))
    out = []
    for (module_id, layer, rank), row in zip(config.tolist(), rows):
        name = _NAMES.get(int(module_id))
        where = f"lora_task_id {task_id}: lora_config row (module {module_id}, layer {layer})"
        if name is None:
            raise AdapterError(f"{where}: module id {module_id} is not supported (supported: "
                               f"{MODULE_IDS})")
        if not 1 <= rank <= max_rank:
            raise AdapterError(f"{where}: adapter size {rank} is over lora.max_rank={max_rank}"
                               if rank > max_rank else f"{where}: adapter size must be >= 1")
        if name == "attn_qkv":
            in_features, out_features = runtime_dims(shape)["qkv"]
        else:
            _, in_features, _, out_features = hf_part(shape, names, NVIDIA_TO_HF[name])
        size = rank * (in_features + out_features)
        if row.numel() < size:
            raise AdapterError(f"{where}: lora_weights row has {row.numel()} values, module "
                               f"{name} of this base model needs {size} (an adapter for "
                               f"another base model?)")
        a = row[:rank * in_features].reshape(rank, in_features)
        b = row[rank * in_features:size].reshape(out_features, rank)
        if name == "attn_qkv":
            if not 0 <= layer < shape.num_hidden_layers:
                raise AdapterError(f"{where}: layer {layer} does not exist, the base model has "
                                   f"{shape.num_hidden_layers} layers")
            check_pair(where, a, b, in_features, out_features, max_rank)
            out.append(Contribution(layer, "qkv", 0, a, b, where))
        else:
            out.append(hf_contribution(where, int(layer), NVIDIA_TO_HF[name], a, b, shape,
                                       names, max_rank))
    return out


def nvidia_tensors(pairs: list[tuple[int, str, torch.Tensor, torch.Tensor]]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights [N, W] float32, lora_config [N, 3] int32) of HF pairs
    (layer, hf module, A [r, in], B [out, r] with the scaling folded in)."""
    rows, config = [], []
    for layer, module, a, b in pairs:
        rows.append(torch.cat([a.float().flatten(), b.float().flatten()]))
        config.append([MODULE_IDS[HF_TO_NVIDIA[module]], layer, a.shape[0]])
    width = max(r.numel() for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    return weights.numpy(), np.asarray(config, dtype=np.int32)

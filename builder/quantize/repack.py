"""TensorRT-LLM checkpoint tensors -> the torch runtime's `model.safetensors`.

The runtime uses the same names except that `mlp.fc` (HF gate_proj) and `mlp.gate` (HF up_proj)
are fused into `mlp.gate_up` ([gate; up] along the output dim), and `lm_head.weight` is dropped when
the embeddings are tied. Quantized tensors are concatenated in their checkpoint form: INT4 packs two
output rows per byte, so the packed [out/2, in] halves stack along dim 0 like the rows they hold.
KV cache scales leave the weights: the runtime reads them from the engine config.
"""
from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"transformer\.layers\.(\d+)\.(.+)")
_KV_SCALE_SUFFIXES = ("attention.k_cache_scaling_factor", "attention.v_cache_scaling_factor",
                      "attention.kv_cache_scaling_factor")
_FP8_SCALAR_KEYS = ("activation_scaling_factor",)


def _fuse_gate_up(fc: dict[str, torch.Tensor], gate: dict[str, torch.Tensor], layer: str
                  ) -> dict[str, torch.Tensor]:
    """Fuse one layer's `mlp.fc` and `mlp.gate` tensors (keyed by suffix) into `mlp.gate_up`."""
    if set(fc) != set(gate):
        raise ValueError(f"{layer}: mlp.fc has {sorted(fc)} but mlp.gate has {sorted(gate)}")
    fused = {}
    for suffix in fc:
        a, b = fc[suffix], gate[suffix]
        if suffix in ("weight", "weights_scaling_factor", "bias") and a.dim() >= 1 and a.numel() > 1:
            fused[suffix] = torch.cat((a, b), dim=0)
        elif suffix == "weights_scaling_factor":  # FP8 per-tensor scales: per row if they differ
            fused[suffix] = a.reshape(1) if torch.equal(a, b) else torch.cat(
                (a.reshape(1).expand(fc["weight"].shape[0]), b.reshape(1).expand(gate["weight"].shape[0])))
        elif suffix == "prequant_scaling_factor":
            if not torch.equal(a, b):
                raise ValueError(f"{layer}: mlp.fc and mlp.gate carry different AWQ pre-quant "
                                 f"scales; they must be resmoothed to one before fusing")
            fused[suffix] = a
        elif suffix in _FP8_SCALAR_KEYS:  # both read the same input: one static scale
            fused[suffix] = torch.maximum(a, b)
        else:
            raise ValueError(f"{layer}: cannot fuse mlp tensor {suffix!r}")
    return fused


def to_runtime_weights(config: dict, tensors: dict[str, torch.Tensor], tie_word_embeddings: bool
                       ) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """(runtime state dict, {"k": [...], "v": [...]} per-layer KV scales or {}) from a checkpoint."""
    state: dict[str, torch.Tensor] = {}
    mlp: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    kv_scales: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for key, tensor in tensors.items():
        match = _LAYER.fullmatch(key)
        if match is None:
            if not (key == "lm_head.weight" and tie_word_embeddings):
                state[key] = tensor
            continue
        layer, rest = match.group(1), match.group(2)
        if rest in _KV_SCALE_SUFFIXES:
            if rest != "attention.kv_cache_scaling_factor":
                kv_scales[rest.split(".")[1][0]][int(layer)] = float(tensor.reshape(-1)[0])
            continue
        module, _, suffix = rest.rpartition(".")
        if module in ("mlp.fc", "mlp.gate"):
            mlp.setdefault((layer, module), {})[suffix] = tensor
            continue
        state[key] = tensor
    layers = sorted({layer for layer, _ in mlp}, key=int)
    for layer in layers:
        fused = _fuse_gate_up(mlp[(layer, "mlp.fc")], mlp[(layer, "mlp.gate")],
                              f"transformer.layers.{layer}")
        for suffix, tensor in fused.items():
            state[f"transformer.layers.{layer}.mlp.gate_up.{suffix}"] = tensor
    num_layers = config["num_hidden_layers"]
    if kv_scales["k"] or kv_scales["v"]:
        if len(kv_scales["k"]) != num_layers or len(kv_scales["v"]) != num_layers:
            raise ValueError("checkpoint: K/V cache scales are missing for some layers")
        return state, {side: [kv_scales[side][i] for i in range(num_layers)] for side in "kv"}
    return state, {}

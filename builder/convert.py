"""Hugging Face Llama-family checkpoint -> the runtime's model shape and weight layout.

The runtime layout uses TensorRT-LLM's names with fused projections: q/k/v become
`attention.qkv`, gate/up become `mlp.gate_up` (see triton_backend/engine/model.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from triton_backend.engine.config import ModelShape

_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def model_shape_from_hf(hf_config: dict) -> ModelShape:
    """Read the model shape from an HF `config.json` (transformers 4.x or 5.x rope fields)."""
    model_type = hf_config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"checkpoint: model_type {model_type!r} is not supported "
                         f"(supported: {sorted(_ARCHITECTURES)})")
    heads = hf_config["num_attention_heads"]
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if hf_config.get("sliding_window") and hf_config.get("use_sliding_window", model_type == "mistral"):
        window, max_pos = hf_config["sliding_window"], hf_config.get("max_position_embeddings", 2048)
        if window < max_pos:
            raise ValueError(f"checkpoint: sliding_window={window} attention is not supported")
    return ModelShape(
        architecture=_ARCHITECTURES[model_type],
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        attention_bias=bool(hf_config.get("attention_bias", model_type == "qwen2")),
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        hidden_act=hf_config.get("hidden_act", "silu"),
    )


def load_hf_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint: no .safetensors weights in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def convert_state_dict(hf_state: dict[str, torch.Tensor], shape: ModelShape,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rename and fuse HF weights into the runtime layout, cast to `dtype`."""
    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise ValueError(f"checkpoint: weight {name!r} is missing")
        return hf_state[name].to(dtype)

    out = {"transformer.vocab_embedding.weight": take("model.embed_tokens.weight"),
           "transformer.ln_f.weight": take("model.norm.weight")}
    for i in range(shape.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"transformer.layers.{i}"
        attn = f"{hf}.self_attn"
        out[f"{ours}.input_layernorm.weight"] = take(f"{hf}.input_layernorm.weight")
        out[f"{ours}.post_layernorm.weight"] = take(f"{hf}.post_attention_layernorm.weight")
        out[f"{ours}.attention.qkv.weight"] = torch.cat(
            [take(f"{attn}.{p}_proj.weight") for p in "qkv"], dim=0)
        if shape.attention_bias:
            out[f"{ours}.attention.qkv.bias"] = torch.cat(
                [take(f"{attn}.{p}_proj.bias") for p in "qkv"], dim=0)
        out[f"{ours}.attention.dense.weight"] = take(f"{attn}.o_proj.weight")
        out[f"{ours}.mlp.gate_up.weight"] = torch.cat(
            [take(f"{hf}.mlp.gate_proj.weight"), take(f"{hf}.mlp.up_proj.weight")], dim=0)
        out[f"{ours}.mlp.proj.weight"] = take(f"{hf}.mlp.down_proj.weight")
        if shape.mlp_bias:
            out[f"{ours}.mlp.gate_up.bias"] = torch.cat(
                [take(f"{hf}.mlp.gate_proj.bias"), take(f"{hf}.mlp.up_proj.bias")], dim=0)
            out[f"{ours}.mlp.proj.bias"] = take(f"{hf}.mlp.down_proj.bias")
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    return {k: v.contiguous() for k, v in out.items()}


def read_hf_config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def eos_token_ids(hf_dir: Path, hf_config: dict) -> list[int]:
    """Every end-of-sequence id: generation_config.json's (often a list), else config.json's."""
    ids: list[int] = []
    gen_path = hf_dir / "generation_config.json"
    sources = [json.loads(gen_path.read_text())] if gen_path.is_file() else []
    sources.append(hf_config)
    for source in sources:
        value = source.get("eos_token_id")
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids

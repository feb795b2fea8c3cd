"""Hugging Face checkpoint -> the runtime's model shape and weight layout, through the model
family of the checkpoint's `model_type` (triton_backend/engine/families/).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from triton_backend.engine import families
from triton_backend.engine.config import ModelShape

def model_shape_from_hf(hf_config: dict) -> ModelShape:
    """The model shape from an HF `config.json`, read by the family of its `model_type`."""
    return families.for_model_type(hf_config.get("model_type")).shape_from_hf(hf_config)


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
    """Rename and fuse HF weights into the runtime layout (the family's table), cast to `dtype`."""
    return families.get(shape.architecture).convert_state_dict(hf_state, shape, dtype)


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

"""The TensorRT-LLM checkpoint (legacy format of TRT-LLM <= 1.2): `config.json` + `rank0.safetensors`.

Written by ModelOpt's exporter (the same one TensorRT-LLM's `quantize.py` calls) so the directory
can be handed to `trtllm-build --checkpoint_dir` on a GPU host unchanged. We then correct what the
exporter gets wrong with transformers 5 (which nests `rope_theta` / `rope_scaling` under
`rope_parameters`): `rotary_base` and `rotary_scaling` are written from the HF config.
The families this exporter refuses (Gemma 3, Mixtral, Qwen3-MoE) are written by our own writer
instead, unquantized (`builder/trtllm/checkpoint.py`; the choice is `builder/trtllm/engine.py`'s).

Per-layer names (W4A16_AWQ shown; see docs/quantization.md for FP8):
`transformer.layers.N.attention.qkv.{weight,weights_scaling_factor,prequant_scaling_factor}`,
`.attention.dense.*`, `.mlp.fc.*` (HF gate_proj), `.mlp.gate.*` (HF up_proj), `.mlp.proj.*`
(down_proj), `.attention.{k,v,kv}_cache_scaling_factor` when the KV cache is quantized.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

CONFIG_FILE = "config.json"
RANK0_FILE = "rank0.safetensors"
CHECKPOINT_DIR = "trtllm_checkpoint"

KV_CACHE_QUANT_ALGOS = {"fp8": "FP8", "int8": "INT8", "none": None}


def rope_fields(hf_config: dict) -> dict:
    """`rotary_base` and (when scaled) `rotary_scaling` as TensorRT-LLM's config names them."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    base = rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
    fields: dict = {"rotary_base": float(base)}
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type != "default":
        fields["rotary_scaling"] = {"type": rope_type, **rope}
    return fields


def export(model: nn.Module, hf_config: dict, dtype: torch.dtype, out_dir: Path, tp: int = 1,
           pp: int = 1) -> dict:
    """Write `model` (quantized or not) as a TensorRT-LLM checkpoint in `out_dir`, split into
    tp * pp ranks (`rank{N}.safetensors`, one config.json); returns the config."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from modelopt.torch.export.model_utils import get_model_type

    decoder_type = get_model_type(model)
    if decoder_type is None:
        raise ValueError(f"checkpoint: ModelOpt cannot export {type(model).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_tensorrt_llm_checkpoint(model, decoder_type, dtype, export_dir=out_dir,
                                       inference_tensor_parallel=tp, inference_pipeline_parallel=pp)
    path = out_dir / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(rope_fields(hf_config))
    config["max_position_embeddings"] = hf_config.get("max_position_embeddings",
                                                      config.get("max_position_embeddings"))
    path.write_text(json.dumps(config, indent=2) + "\n")
    return config


def read(checkpoint_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a single-rank TensorRT-LLM checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path, weights_path = checkpoint_dir / CONFIG_FILE, checkpoint_dir / RANK0_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the TensorRT-LLM checkpoint")
    config = json.loads(config_path.read_text())
    if config.get("mapping", {}).get("world_size", 1) != 1:
        raise ValueError(f"{checkpoint_dir}: only single-rank checkpoints are read here")
    return config, load_file(str(weights_path))


def checkpoint_quant_modes(config: dict) -> tuple[str | None, str | None]:
    """(quant_algo, kv_cache_quant_algo) from a checkpoint config."""
    quant = config.get("quantization") or {}
    return quant.get("quant_algo"), quant.get("kv_cache_quant_algo")

"""What every engine target (torch, naive, trtllm) writes alike: the engine config made from the
spec and the checkpoint, and the tokenizer files copied beside the weights."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from builder.pipeline import convert
from builder.spec.build_spec import BuildSpec, default_limits
from builder.spec.torch_gpu import gpu_limits, is_gpu_engine, kv_free_fraction
from triton_backend.engine.config import TOKENIZER_DIR, EngineConfig, QuantConfig, TokenizerInfo

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")


def engine_config_for(spec: BuildSpec, hf_dir: Path, hf_config: dict) -> EngineConfig:
    shape = convert.model_shape_from_hf(hf_config)
    tokenizer = TokenizerInfo(dir=TOKENIZER_DIR, eos_token_ids=convert.eos_token_ids(hf_dir, hf_config),
                              bos_token_id=hf_config.get("bos_token_id"),
                              pad_token_id=hf_config.get("pad_token_id"),
                              has_chat_template=_has_chat_template(hf_dir))
    quant = QuantConfig(weights=spec.quantization.weights, kv_cache=spec.quantization.kv_cache,
                        group_size=spec.quantization.group_size,
                        exclude_modules=list(spec.quantization.exclude_modules),
                        lm_head=spec.quantization.lm_head)
    limits = spec.limits or default_limits(shape.max_position_embeddings)
    kv_cache, extra = spec.kv_cache, {}
    if spec.target == "torch" and is_gpu_engine(spec.hardware):
        limits, extra["gpu"] = gpu_limits(spec, shape, limits)
        kv_cache = dataclasses.replace(kv_cache, free_gpu_mem_fraction=kv_free_fraction(spec))
    return EngineConfig(name=spec.name, target=spec.target, dtype=spec.dtype, model=shape,
                        limits=limits, kv_cache=kv_cache, quantization=quant,
                        tokenizer=tokenizer, hardware=spec.hardware,
                        speculative=dataclasses.replace(spec.speculative), extra=extra)


def _has_chat_template(hf_dir: Path) -> bool:
    if (hf_dir / "chat_template.jinja").is_file():
        return True
    config = hf_dir / "tokenizer_config.json"
    return config.is_file() and '"chat_template"' in config.read_text()


def copy_tokenizer(hf_dir: Path, engine_dir: Path) -> None:
    target = engine_dir / TOKENIZER_DIR
    target.mkdir(parents=True, exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied and "vocab.json" not in copied:
        raise ValueError(f"checkpoint: {hf_dir} has no tokenizer files")
    for name in copied:
        shutil.copy2(hf_dir / name, target / name)

"""LoRA adapters at build time: the spec's `lora:` section, PEFT checkpoints read and checked
against the base model, and written into the engine directory in the runtime layout.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (keys like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). Every error names the
adapter (`lora.adapters.<name>`) and the module.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.pipeline.checkpoint import sha256_file
from triton_backend.engine.config import (LORA_ADAPTERS_DIR, LoraAdapterInfo, LoraConfig,
                                          ModelShape)
from triton_backend.engine.numbers import is_int
# Importing the spec must stay cheap (the build key imports no torch): torch comes with the
# functions that read weights.
if TYPE_CHECKING:
    import torch

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])\.weight")


@dataclass
class LoraSpec:
    """The spec's `lora:` section: `adapters` maps a name (the model name clients use) to a PEFT
    adapter directory; task ids are given in the order listed, from 1."""

    adapters: dict = field(default_factory=dict)
    max_rank: int = 64
    max_loras: int = 8
    max_cpu_loras: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.adapters, dict):
            raise ValueError(f"lora.adapters must be a mapping of name: PEFT adapter directory, "
                             f"got {type(self.adapters).__name__}")
        for name, path in self.adapters.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"lora.adapters: name {name!r}: letters, digits, '.', '_' and "
                                 f"'-' only")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora.adapters.{name}: must be a PEFT adapter directory, "
                                 f"got {path!r}")
        LoraConfig(self.max_rank, self.max_loras, self.max_cpu_loras)  # the limits' checks
        if len(self.adapters) > self.max_cpu_loras:
            raise ValueError(f"lora.adapters: {len(self.adapters)} adapters, more than "
                             f"lora.max_cpu_loras={self.max_cpu_loras}")

    def adapter_dirs(self, base: Path | None = None) -> dict[str, Path]:
        """name -> directory; relative paths are relative to `base` (the spec's directory)."""
        out = {}
        for name, path in self.adapters.items():
            p = Path(path).expanduser()
            out[name] = p if p.is_absolute() or base is None else base / p
        return out


@dataclass
class PeftAdapter:
    name: str
    rank: int
    target_modules: list[str]
    pairs: list[tuple[int, str, torch.Tensor, torch.Tensor]]  # layer, module, A, B (scaled)
    base_model: str | None


def _read_config(where: str, path: Path) -> dict:
    """adapter_config.json, with what the runtime cannot serve refused."""
    from triton_backend.engine.lora.layout import AdapterError

    if not (path / PEFT_CONFIG).is_file() or not (path / PEFT_WEIGHTS).is_file():
        raise AdapterError(f"{where}: {path} is not a PEFT adapter directory (needs "
                           f"{PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        config = json.loads((path / PEFT_CONFIG).read_text())
    except ValueError as exc:
        raise AdapterError(f"{where}: {PEFT_CONFIG} is not valid JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {"use_dora": bool(config.get("use_dora")),
                   "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
                   "bias": config.get("bias", "none") != "none"}
    for key, bad in unsupported.items():
        if bad:
            raise AdapterError(f"{where}: {PEFT_CONFIG} {key}={config.get(key)!r} is not "
                               f"supported")
    rank = config.get("r")
    if not is_int(rank) or rank < 1:
        raise AdapterError(f"{where}: {PEFT_CONFIG} r must be an integer >= 1, got {rank!r}")
    return config


def projections(shape: ModelShape):
    """The projections the base model's family lets an adapter touch (`Projections`)."""
    from triton_backend.engine import families
    from triton_backend.engine.lora.layout import Projections

    return Projections.of(families.get(shape.architecture).lora_parts())


def _target_modules(where: str, config: dict, shape: ModelShape) -> dict[tuple[int, str], str]:
    """(layer, module) -> HF module name of every projection the config says it adapts."""
    from triton_backend.engine.lora.layout import AdapterError

    names = projections(shape)
    targets = config.get("target_modules") or []
    layers = config.get("layers_to_transform")
    layers = range(shape.num_hidden_layers) if layers is None else (
        [layers] if isinstance(layers, int) else layers)
    wanted = {}
    for layer in layers:
        for module in names.hf_modules:
            name = names.hf_module_name(layer, module)
            if isinstance(targets, str):
                hit = re.fullmatch(targets, name) is not None
            else:
                hit = module in targets or name in targets
            if hit:
                wanted[(layer, module)] = name
    if not isinstance(targets, str):
        for module in targets:
            if module.split(".")[-1] not in names.hf_modules:
                raise AdapterError(f"{where}: module {module}: LoRA on it is not supported "
                                   f"(supported: {sorted(names.hf_modules)})")
    return wanted


def read_peft_adapter(name: str, path: Path, shape: ModelShape, max_rank: int) -> PeftAdapter:
    """Read and check a PEFT adapter against the base model `shape`."""
    from safetensors.torch import load_file

    from triton_backend.engine.lora.layout import AdapterError

    names = projections(shape)
    where = f"lora.adapters.{name}"
    config = _read_config(where, path)
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(f"{where}: rank r={rank} is over lora.max_rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / PEFT_WEIGHTS)).items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"{where}: weight {key!r} is not a LoRA pair of a decoder "
                               f"projection (supported: {sorted(names.hf_modules)})")
        layer, module = int(match.group(1)), match.group(3)
        found.setdefault((layer, module), {})[match.group(4)] = tensor
    wanted = _target_modules(where, config, shape)
    for (layer, module), module_name in wanted.items():
        if set(found.get((layer, module), {})) != {"A", "B"}:
            raise AdapterError(f"{where}: module {module_name}: lora_A/lora_B weights are "
                               f"missing from {PEFT_WEIGHTS} (target_modules lists it)")
    pairs = []
    for (layer, module), ab in sorted(found.items()):
        module_where = f"{where}: module {names.hf_module_name(layer, module)}"
        if (layer, module) not in wanted:
            raise AdapterError(f"{module_where}: has weights but is not in target_modules")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{module_where}: lora_A/lora_B weights are missing")
        a, b = ab["A"].float(), ab["B"].float() * scaling
        if a.shape[0] != rank:
            raise AdapterError(f"{module_where}: lora_A has rank {a.shape[0]}, "
                               f"{PEFT_CONFIG} says r={rank}")
        pairs.append((layer, module, a, b))
    if not pairs:
        raise AdapterError(f"{where}: {PEFT_WEIGHTS} holds no LoRA weights")
    return PeftAdapter(name, rank, sorted({m for _, m, _, _ in pairs}), pairs,
                       config.get("base_model_name_or_path"))


def adapter_dtype(engine_dtype: str) -> torch.dtype:
    """fp32 engines keep fp32 adapters; every other engine (bf16, and INT4/FP8 weights with
    bf16 activations) serves bf16 adapters."""
    import torch

    return torch.float32 if engine_dtype == "float32" else torch.bfloat16


def runtime_state(adapter: PeftAdapter, shape: ModelShape, max_rank: int,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from triton_backend.engine.lora.layout import fuse, hf_contribution

    where, names = f"lora.adapters.{adapter.name}", projections(shape)
    contributions = [hf_contribution(f"{where}: module {names.hf_module_name(layer, module)}",
                                     layer, module, a, b, shape, names, max_rank)
                     for layer, module, a, b in adapter.pairs]
    return fuse(contributions, shape, names, dtype)


def write_adapters(spec: LoraSpec, base: Path | None, shape: ModelShape, engine_dtype: str,
                   engine_dir: Path, log=lambda message: None) -> LoraConfig:
    """Check every adapter of `spec`, write each into `engine_dir/lora/<name>.safetensors`;
    returns the engine's `lora` config section."""
    from safetensors.torch import save_file

    out_dir = engine_dir / LORA_ADAPTERS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    infos = []
    for task_id, (name, path) in enumerate(spec.adapter_dirs(base).items(), start=1):
        adapter = read_peft_adapter(name, path, shape, spec.max_rank)
        state = runtime_state(adapter, shape, spec.max_rank, adapter_dtype(engine_dtype))
        file = out_dir / f"{name}.safetensors"
        save_file(state, str(file), metadata={"format": "pt"})
        infos.append(LoraAdapterInfo(name=name, task_id=task_id,
                                     file=f"{LORA_ADAPTERS_DIR}/{file.name}", rank=adapter.rank,
                                     sha256=sha256_file(file),
                                     target_modules=adapter.target_modules, source=str(path)))
        log(f"adapter {name} (task id {task_id}): rank {adapter.rank}, "
            f"{', '.join(adapter.target_modules)}")
    return LoraConfig(spec.max_rank, spec.max_loras, spec.max_cpu_loras, infos)


def adapter_source_files(lora: Any, base: Path | None = None) -> dict[str, Path]:
    """`adapter-name/file` -> path of every file the build key hashes for a raw `lora:` spec."""
    if not isinstance(lora, dict) or not isinstance(lora.get("adapters"), dict):
        return {}
    files = {}
    for name, path in lora["adapters"].items():
        root = Path(str(path)).expanduser()
        if not root.is_absolute() and base is not None:
            root = base / root
        for file_name in (PEFT_CONFIG, PEFT_WEIGHTS):
            files[f"{name}/{file_name}"] = root / file_name
    return files

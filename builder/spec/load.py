"""Reading a build spec: YAML -> sections -> `BuildSpec` -> the checks across sections
(`checks.py`). Unknown keys and bad values raise `SpecError` naming the key."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from builder.pipeline.lora import LoraSpec
from builder.spec.build_spec import (BuildSpec, ParallelismSpec, QuantizationSpec, ServingSpec,
                                     SpecError, parse_bytes, section_error)
from builder.spec.checks import check_spec
from builder.spec.deployment import DeploymentSpec, check_keys
from triton_backend.engine.config import KVCacheConfig, Limits, SpeculativeConfig

_SECTIONS = {"limits": Limits, "kv_cache": KVCacheConfig, "quantization": QuantizationSpec,
             "parallelism": ParallelismSpec, "speculative": SpeculativeConfig,
             "serving": ServingSpec, "lora": LoraSpec, "deployment": DeploymentSpec}


def _build_section(key: str, klass: type, raw: Any) -> Any:
    try:
        raw = dict(check_keys(key, klass, raw))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if key == "kv_cache" and raw.get("memory_bytes") is not None:
        raw["memory_bytes"] = parse_bytes("kv_cache.memory_bytes", raw["memory_bytes"])
    try:
        return klass(**raw)
    except SpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise section_error(key, exc) from None


def spec_from_dict(data: dict, source: Path | None = None) -> BuildSpec:
    if not isinstance(data, dict):
        raise SpecError("spec: the top level must be a mapping")
    known = {f.name for f in dataclasses.fields(BuildSpec)} - {"source"}
    for key in data:
        if key not in known:
            raise SpecError(f"{key}: unknown key (known: {sorted(known)})")
    for key in ("name", "checkpoint"):
        if not data.get(key):
            raise SpecError(f"{key}: required")
    kwargs = dict(data)
    for key, klass in _SECTIONS.items():
        if key in kwargs:
            kwargs[key] = _build_section(key, klass, kwargs[key] or {})
    if kwargs.get("lora") is not None and source is not None:
        # relative adapter paths are relative to the spec's directory, whatever the cwd
        lora = kwargs["lora"]
        lora.adapters = {name: os.path.normpath(path) for name, path
                         in lora.adapter_dirs(Path(source).resolve().parent).items()}
    spec = BuildSpec(source=source, **kwargs)
    check_spec(spec)
    return spec


def load_spec(path: str | Path, overrides: dict | None = None,
              quantization_overrides: dict | None = None) -> BuildSpec:
    """Read a YAML spec; `overrides` (from command-line flags) replace top-level keys and
    `quantization_overrides` keys of the `quantization` section (None values are ignored)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    quant = {k: v for k, v in (quantization_overrides or {}).items() if v is not None}
    if quant:
        data["quantization"] = {**(data.get("quantization") or {}), **quant}
    return spec_from_dict(data, source=path)

"""Model families: one module each in this package, registered under the HF `model_type`s it reads.

A family (`llama.LlamaFamily` or a subclass) holds everything that differs between model
families: reading the shape from an HF `config.json`, the one table of HF -> runtime weight names
(used by conversion, ModelOpt's quantization and LoRA), the module tree the runtime builds (and
the parameter count, read off it), and whether the C++ one-call decode path
(`cpu/forward.py`) runs its layers.
Adding a family is adding a module here that declares its `FAMILIES`; nothing else lists them;
what several families share lives in a module whose name starts with `_` (not loaded as one)
(the module imports nothing from this package's `__init__`, so the registry it loads never
imports itself back).
The engine config names its family in `model.architecture`.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton_backend.engine.families.llama import LlamaFamily

_FAMILIES: dict[str, "LlamaFamily"] = {}
_loaded = False


def _load() -> dict[str, "LlamaFamily"]:
    global _loaded
    if not _loaded:
        for module in pkgutil.iter_modules(__path__):
            if module.name.startswith("_"):  # shared parts of families (_moe_layout)
                continue
            for family in importlib.import_module(f"{__name__}.{module.name}").FAMILIES:
                if family.name in _FAMILIES:
                    raise ValueError(f"model family {family.name!r} is declared twice")
                _FAMILIES[family.name] = family
        _loaded = True
    return _FAMILIES


def architectures() -> list[str]:
    return sorted(_load())


def get(architecture: str) -> "LlamaFamily":
    """The family named by an engine config's `model.architecture`."""
    families = _load()
    if architecture not in families:
        raise ValueError(f"model.architecture must be one of {sorted(families)}, "
                         f"got {architecture!r}")
    return families[architecture]


def for_model_type(model_type: str | None) -> "LlamaFamily":
    """The family that reads an HF checkpoint whose config.json says `model_type`."""
    for family in _load().values():
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in _FAMILIES.values() for t in f.model_types)
    raise ValueError(f"checkpoint: model_type {model_type!r} is not supported "
                     f"(supported: {supported})")

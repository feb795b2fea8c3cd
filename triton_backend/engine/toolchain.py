"""The toolchain an engine was built with (recorded in manifest.json), and refusing another one.

A TensorRT-LLM engine only loads under the TensorRT-LLM and TensorRT it was built with, on the GPU
architecture it was built for; loaded elsewhere it crashes deep in the runtime. Our torch engines
are checked against the llm-forge that built them (its build key changes with the version, so a
stale engine is rebuilt, never half-read). Only what both the manifest and this machine know is
compared: a CPU machine without TensorRT-LLM can still emit a trtllm engine's repository.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

MANIFEST_FILE = "manifest.json"
# What must match to load an engine of each target.
CHECKED = {"torch": ("llm-forge",), "naive": ("llm-forge",),
           "trtllm": ("tensorrt_llm", "tensorrt", "gpu_sm")}


class ToolchainMismatch(ValueError):
    """The engine was built by another toolchain; the message names both versions."""


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_facts() -> dict:
    """CUDA version and the first GPU's SM, only where TensorRT-LLM (hence a GPU torch) is here."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return {"cuda": None, "gpu_sm": None}
    import torch

    if not torch.cuda.is_available():
        return {"cuda": torch.version.cuda, "gpu_sm": None}
    major, minor = torch.cuda.get_device_capability(0)
    return {"cuda": torch.version.cuda, "gpu_sm": major * 10 + minor}


def current_toolchain(target: str) -> dict:
    """The versions on this machine that matter for `target` (None: not installed here)."""
    toolchain = {"llm-forge": package_version("llm-forge"), "torch": package_version("torch")}
    if target == "trtllm":
        toolchain.update(tensorrt_llm=package_version("tensorrt_llm") or package_version("tensorrt-llm"),
                         tensorrt=package_version("tensorrt"), **_cuda_facts())
    return toolchain


def recorded_toolchain(engine_dir: str | Path) -> dict | None:
    path = Path(engine_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("toolchain")


def mismatches(recorded: dict, current: dict, target: str) -> list[str]:
    """`key: built with X, here Y` for each checked key both sides know and that differs."""
    found = []
    for key in CHECKED.get(target, ()):
        built, here = recorded.get(key), current.get(key)
        if built is not None and here is not None and str(built) != str(here):
            found.append(f"{key}: built with {built}, this machine has {here}")
    return found


def check_toolchain(engine_dir: str | Path, target: str) -> None:
    """Raise ToolchainMismatch when the engine's recorded toolchain differs from this machine's.

    Engines without a recorded toolchain (built before it was recorded, or written by hand in
    tests) are not checked.
    """
    recorded = recorded_toolchain(engine_dir)
    if not recorded:
        return
    found = mismatches(recorded, current_toolchain(target), target)
    if found:
        raise ToolchainMismatch(f"{engine_dir}: engine built by another toolchain ("
                                + "; ".join(found) + "); rebuild it here (forge engine --force)")

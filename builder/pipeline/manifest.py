"""`manifest.json`: what an engine was built from and with, so a build can be traced and reproduced."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import time
from pathlib import Path

from builder.pipeline.checkpoint import sha256_file
from builder.spec.build_spec import BuildSpec
from triton_backend.engine.config import MANIFEST_FILE
from triton_backend.engine.toolchain import current_toolchain


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_manifest(engine_dir: Path, spec: BuildSpec, hf_dir: Path, extra: dict | None = None) -> Path:
    checkpoint_files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    manifest = {
        "spec": {"path": spec.source.name if spec.source else None,
                 "sha256": sha256_file(spec.source) if spec.source else None,
                 "checkpoint": spec.checkpoint},
        "checkpoint_files": {p.name: sha256_file(p) for p in checkpoint_files},
        "versions": {name: _version(name) for name in
                     ("llm-forge", "torch", "transformers", "tokenizers", "safetensors", "gguf",
                      "nvidia-modelopt", "tensorrt_llm")},
        "python": platform.python_version(),
        # What loading checks (triton_backend/engine/toolchain.py): the engine needs the same.
        "toolchain": current_toolchain(spec.target),
        "build_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The spec's serving sections: `forge repository` starts from them, not from defaults.
        "repository": dict(spec.repository),
        "serving": dataclasses.asdict(spec.serving),
        **_lora_entries(spec, engine_dir),
        **(extra or {}),
    }
    path = engine_dir / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def _lora_entries(spec: BuildSpec, engine_dir: Path) -> dict:
    """The adapters built in: task id, the sha256 of the runtime-layout file and of the PEFT
    files it came from."""
    if spec.lora is None:
        return {}
    from builder.pipeline.lora import adapter_source_files

    sources = adapter_source_files(dataclasses.asdict(spec.lora))
    adapters = {}
    for task_id, name in enumerate(spec.lora.adapters, start=1):
        engine_file = engine_dir / "lora" / f"{name}.safetensors"  # torch target
        if not engine_file.is_file():  # trtllm target: NVIDIA's request tensors
            engine_file = engine_dir / "lora" / name / "model.lora_weights.npy"
        adapters[name] = {
            "task_id": task_id,
            "sha256": sha256_file(engine_file) if engine_file.is_file() else None,
            "source_files": {key.split("/", 1)[1]: sha256_file(path)
                             for key, path in sources.items() if key.split("/", 1)[0] == name}}
    return {"lora_adapters": adapters}


def spec_serving_sections(engine_dir: Path) -> tuple[dict, dict]:
    """The (`repository:`, `serving:`) sections of the spec `engine_dir` was built from, as its
    manifest recorded them; empty for an engine built before they were recorded."""
    try:
        manifest = json.loads((engine_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}, {}
    return dict(manifest.get("repository") or {}), dict(manifest.get("serving") or {})

"""The build key: everything an engine is a function of, so CI rebuilds only what changed.

Components: the spec as given (after command-line overrides; `output` excluded, the key lives in
the engine directory itself; `deployment` excluded, it changes the manifests, never the engine), the sha256 of every checkpoint source file, the calibration and
evaluation data of a quantized build, the toolchain versions of the target, and llm-forge's
version. `build_key.json` in the engine directory keeps the components, so a mismatch can say what
changed. Computing the key imports neither torch nor transformers: an up-to-date `forge engine`
answers in well under a second.

File hashes are reused from the previous key when a file's size and mtime are unchanged (as make
and ccache trust mtimes); any write to a file changes its mtime and forces a new hash.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import builder
from builder.pipeline.checkpoint import PYPI_PREFIX, find_packaged_gguf, sha256_file
from triton_backend.engine.toolchain import package_version

KEY_FILE = "build_key.json"
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUILTIN_DATA = {"builtin": DATA_DIR / "calibration.txt", "builtin:heldout": DATA_DIR / "heldout.txt"}
TOOLCHAIN_PACKAGES = {"torch": ("torch", "transformers", "safetensors", "gguf"),
                      "naive": ("torch", "transformers", "safetensors", "gguf"),
                      "trtllm": ("tensorrt_llm", "tensorrt", "transformers", "nvidia-modelopt")}


def checkpoint_files(source: str) -> list[Path]:
    """The files a checkpoint source consists of (what its hashes cover)."""
    if source.startswith(PYPI_PREFIX):
        return [find_packaged_gguf(source[len(PYPI_PREFIX):])]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
    raise ValueError(f"checkpoint: {source!r} is neither a checkpoint directory, a .gguf file, "
                     f"nor {PYPI_PREFIX}PACKAGE")


@dataclass
class FileHasher:
    """sha256 of files, reusing hashes recorded with the same size and mtime."""

    known: dict = field(default_factory=dict)  # path -> {"sha256", "size", "mtime_ns"}
    seen: dict = field(default_factory=dict)

    def __call__(self, path: Path) -> str:
        stat = path.stat()
        key = str(path.resolve())
        old = self.known.get(key)
        if old and old["size"] == stat.st_size and old["mtime_ns"] == stat.st_mtime_ns:
            digest = old["sha256"]
        else:
            digest = sha256_file(path)
        self.seen[key] = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return digest


def _data_files(spec: dict) -> dict[str, Path]:
    quant = spec.get("quantization") or {}
    if quant.get("weights", "none") == "none" and quant.get("kv_cache", "none") == "none":
        return {}
    calibration = (quant.get("calibration") or {}).get("dataset", "builtin")
    evaluation = (quant.get("quality") or {}).get("dataset", "builtin:heldout")
    return {role: BUILTIN_DATA.get(name, Path(name))
            for role, name in (("calibration", calibration), ("evaluation", evaluation))}


def components(spec: dict, hasher: FileHasher) -> dict:
    """The key's inputs, as plain JSON data."""
    spec = {k: v for k, v in spec.items() if k not in ("output", "deployment")}
    source = str(spec.get("checkpoint", ""))
    files = checkpoint_files(source)
    root = Path(source).expanduser()
    names = {p: (str(p.relative_to(root)) if root.is_dir() else p.name) for p in files}
    data = {role: hasher(path) if path.is_file() else f"missing: {path}"
            for role, path in _data_files(spec).items()}
    target = spec.get("target", "torch")
    from builder.pipeline.lora import adapter_source_files

    lora = {key: hasher(path) if path.is_file() else f"missing: {path}"
            for key, path in adapter_source_files(spec.get("lora")).items()}
    parts = {"spec": spec,
             "checkpoint": {names[p]: hasher(p) for p in files},
             "data": data,
             "toolchain": {name: package_version(name)
                           for name in TOOLCHAIN_PACKAGES.get(target, ())},
             "llm_forge": builder.__version__}
    if lora:  # only engines with adapters carry the part (the others' keys stay as they were)
        parts["lora"] = lora
    return parts


def digest(parts: dict) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class BuildKey:
    key: str
    parts: dict
    file_stats: dict

    @classmethod
    def compute(cls, spec: dict, engine_dir: Path) -> "BuildKey":
        previous = read_key(engine_dir)
        hasher = FileHasher(known=(previous or {}).get("file_stats", {}))
        parts = components(spec, hasher)
        return cls(digest(parts), parts, hasher.seen)

    def save(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / KEY_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "components": self.parts,
                                   "file_stats": self.file_stats}, indent=2, default=str) + "\n")
        os.replace(tmp, path)
        return path

    def stale_reason(self, engine_dir: Path) -> str | None:
        """Why `engine_dir` needs a rebuild for this key (None: up to date)."""
        from triton_backend.engine.config import CONFIG_FILE

        previous = read_key(engine_dir)
        if not (Path(engine_dir) / CONFIG_FILE).is_file():
            return f"no engine at {engine_dir}"
        if previous is None:
            return f"{engine_dir} has no {KEY_FILE} (built before build keys, or by hand)"
        if previous.get("key") == self.key:
            return None
        return explain(previous.get("components", {}), self.parts)


def read_key(engine_dir: Path) -> dict | None:
    path = Path(engine_dir) / KEY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict) and data:
        flat = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


def explain(old: dict, new: dict) -> str:
    """The first differences between two component sets, named in the user's terms."""
    labels = {"spec": "spec", "checkpoint": "checkpoint file", "data": "quantization data",
              "lora": "LoRA adapter file",
              "toolchain": "toolchain", "llm_forge": "llm-forge version"}
    changes = []
    for part, label in labels.items():
        before, after = _flatten(old.get(part)), _flatten(new.get(part))
        for name in sorted(set(before) | set(after)):
            if before.get(name, "<absent>") != after.get(name, "<absent>"):
                what = f"{label} {name}".rstrip() if name else label
                if part in ("checkpoint", "data", "lora"):
                    changes.append(f"{what} changed")
                else:
                    changes.append(f"{what}: {before.get(name, '<absent>')} -> "
                                   f"{after.get(name, '<absent>')}")
    return "; ".join(changes[:5]) + ("; ..." if len(changes) > 5 else "") if changes \
        else "build key changed"

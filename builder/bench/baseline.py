"""`--baseline naive`: the naive baseline of an engine, built and served on demand.

From an engine directory it reads the checkpoint the engine was built from (`manifest.json`) and
its dtype and limits (`config.json`), builds a `naive` engine of the same checkpoint beside it
(`<engine>-naive`, reused when already there), emits its Triton repository into a temporary
directory and serves it on free loopback ports for the duration of the bench.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from triton_backend.engine.config import MANIFEST_FILE, EngineConfig


def naive_engine_dir(engine_dir: Path) -> Path:
    return engine_dir.parent / f"{engine_dir.name}-naive"


def ensure_naive_engine(engine_dir: str | Path, log: Callable[[str], None] = print) -> Path:
    """The naive engine of `engine_dir`'s checkpoint (built when missing); returns its directory."""
    from builder.pipeline.checkpoint import resolve_checkpoint
    from builder.pipeline.naive import build_naive_engine
    from builder.spec.load import spec_from_dict

    engine_dir = Path(engine_dir)
    config = EngineConfig.load(engine_dir)
    if config.target == "naive":
        return engine_dir
    manifest_path = engine_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ValueError(f"--engine: {engine_dir} has no {MANIFEST_FILE} (which checkpoint?)")
    checkpoint = json.loads(manifest_path.read_text())["spec"]["checkpoint"]
    target = naive_engine_dir(engine_dir)
    if (target / "config.json").is_file():
        built_from = json.loads((target / MANIFEST_FILE).read_text())["spec"]["checkpoint"]
        if built_from == checkpoint:
            log(f"reusing the naive baseline {target}")
            return target
    spec = spec_from_dict({"name": f"{config.name}-naive", "checkpoint": checkpoint,
                           "target": "naive", "dtype": config.dtype, "hardware": config.hardware,
                           "limits": asdict(config.limits)})
    log(f"building the naive baseline {target} from {checkpoint}")
    return build_naive_engine(spec, resolve_checkpoint(checkpoint, log), target, log)


@contextlib.contextmanager
def serve_naive_baseline(engine_dir: str | Path, log: Callable[[str], None] = print
                         ) -> Iterator[object]:
    """A running tritonserver with the naive baseline of `engine_dir`; stopped on exit."""
    from builder.repository.emit import RepositoryOptions, emit_repository
    from builder.serving.serve import start_tritonserver

    naive = ensure_naive_engine(engine_dir, log)
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-naive-"))
    try:
        repository = emit_repository(naive, workdir / "repository", RepositoryOptions())
        log("starting tritonserver for the naive baseline")
        server = start_tritonserver(repository, ready_timeout=600)
        try:
            log(f"naive baseline ready on grpc {server.grpc_url}")
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

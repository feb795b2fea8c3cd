"""Build a `naive` target engine: the HF checkpoint itself, run by `transformers` generate.

The engine directory has the same `config.json` (EngineConfig, target "naive"), `tokenizer/` and
`manifest.json` as a torch engine, plus `hf/` holding the checkpoint; there are no converted
weights. The repository emitter and the `tensorrt_llm` model treat it like any engine; only the
executor differs (`triton_backend.naive.NaiveExecutor`).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from builder.pipeline import convert
from builder.pipeline.manifest import write_manifest
from builder.spec.build_spec import BuildSpec
from triton_backend.naive.executor import HF_DIR

# Everything transformers needs to load the model; tokenizer files go to tokenizer/ instead.
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def copy_checkpoint(hf_dir: Path, target: Path) -> list[str]:
    """Copy the model files (config + safetensors shards) of `hf_dir` into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    names = [n for n in _MODEL_FILES if (hf_dir / n).is_file()]
    names += sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not any(n.endswith(".safetensors") for n in names):
        raise ValueError(f"checkpoint: {hf_dir} has no .safetensors weights (the naive target "
                         "loads the checkpoint with transformers)")
    for name in names:
        shutil.copy2(hf_dir / name, target / name)
    return names


def build_naive_engine(spec: BuildSpec, hf_dir: Path, engine_dir: Path | None = None,
                       log: Callable[[str], None] = print) -> Path:
    """Write the naive engine for `spec` (target "naive") from the resolved checkpoint `hf_dir`
    into `engine_dir` (default `spec.output_dir`); returns the engine directory. The directory is
    assembled beside the target and renamed into place, so a failed build leaves no half engine."""
    from builder.pipeline.engine_files import copy_tokenizer, engine_config_for
    from builder.pipeline.install import check_replaceable, staging_dir, swap_in

    if spec.target != "naive":
        raise ValueError(f"target: build_naive_engine builds target 'naive', got {spec.target!r}")
    engine_dir = Path(engine_dir) if engine_dir is not None else spec.output_dir
    hf_dir = Path(hf_dir)
    config = engine_config_for(spec, hf_dir, convert.read_hf_config(hf_dir))
    check_replaceable(engine_dir)
    tmp_dir = staging_dir(engine_dir)
    names = copy_checkpoint(hf_dir, tmp_dir / HF_DIR)
    log(f"checkpoint copied to {HF_DIR}/ ({', '.join(names)})")
    copy_tokenizer(hf_dir, tmp_dir)
    config.save(tmp_dir)
    write_manifest(tmp_dir, spec, hf_dir)
    swap_in(tmp_dir, engine_dir)
    log(f"naive engine ({config.dtype}, transformers generate, one request at a time): {engine_dir}")
    return engine_dir

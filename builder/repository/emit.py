"""Emit the Triton model repository for an engine: ensemble + preprocessing + tensorrt_llm +
postprocessing + tensorrt_llm_bls, rendered from `model_repository/templates/`.

The repository is self-describing: the engine, tokenizer and `triton_backend` locations are
model parameters, written relative to the repository directory when the two share a parent
directory (so the pair can be moved or mounted together into NVIDIA's Triton container), absolute
otherwise. Everything a user may tune comes from `RepositoryOptions` (options.py);
everything else comes from the engine's `config.json`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.pipeline.install import swap_in
from builder.repository import device as repository_device, trtllm as repository_trtllm
from builder.repository.options import RepositoryOptions
from builder.repository.template import render
from triton_backend.engine.config import EngineConfig

if TYPE_CHECKING:
    from builder.spec.build_spec import ServingSpec

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "templates"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
# The Python models share one shim template (`1/model.py`): model -> (module, class) it loads.
PYTHON_MODELS = {"preprocessing": ("preprocessing", "PreprocessingModel"),
                 "tensorrt_llm": ("tensorrt_llm", "TensorrtLlmModel"),
                 "postprocessing": ("postprocessing", "PostprocessingModel"),
                 "tensorrt_llm_bls": ("tensorrt_llm_bls", "BlsModel")}
SHIM_TEMPLATE = "python_model.py.tmpl"
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # holds the triton_backend package


def portable_path(target: Path, repository_dir: Path) -> str:
    """`target` relative to `repository_dir` when they share a parent below `/`, else absolute."""
    target, repository_dir = target.resolve(), repository_dir.resolve()
    common = Path(os.path.commonpath([target, repository_dir]))
    if common == Path(common.anchor):
        return str(target)
    return os.path.relpath(target, repository_dir)


def serving_values(config: EngineConfig, serving: "ServingSpec | None" = None) -> dict:
    """The `tensorrt_llm` model's admission and priority parameters (the spec's `serving:`)."""
    from builder.spec.build_spec import ServingSpec

    serving = serving or ServingSpec()
    return {"max_waiting_requests": serving.max_waiting_requests,
            "max_waiting_prompt_tokens": serving.waiting_prompt_tokens(config.limits),
            "priority_aging_rate": float(serving.priority_aging_rate)}


def template_values(config: EngineConfig, engine_dir: Path, output_dir: Path,
                    options: RepositoryOptions,
                    serving: "ServingSpec | None" = None) -> dict[str, object]:
    """Every placeholder value of every template, from the engine config, the repository options
    and the spec's `serving:` section (None: its defaults)."""
    engine_dir = engine_dir.resolve()
    opt = options
    return {
        **serving_values(config, serving),
        **repository_device.template_values(config, options),
        "triton_max_batch_size": opt.triton_max_batch_size or config.limits.max_batch_size,
        "max_queue_size": opt.max_queue_size,
        "max_queue_delay_microseconds": opt.max_queue_delay_microseconds,
        "decoupled": opt.decoupled,
        "preprocessing_instance_count": opt.preprocessing_instance_count,
        "tensorrt_llm_instance_count": opt.tensorrt_llm_instance_count,
        "postprocessing_instance_count": opt.postprocessing_instance_count,
        "postprocessing_batching": ("" if opt.postprocessing_instance_count == 1 else
                                    "dynamic_batching {\n  preserve_ordering: true\n}\n"),
        "bls_instance_count": opt.bls_instance_count,
        "bls_max_concurrent_requests": opt.bls_max_concurrent_requests,
        "python_path": portable_path(PROJECT_ROOT, output_dir),
        "engine_dir": portable_path(engine_dir, output_dir),
        "tokenizer_dir": portable_path(engine_dir / config.tokenizer.dir, output_dir),
        "add_special_tokens": opt.add_special_tokens,
        "skip_special_tokens": opt.skip_special_tokens,
        "exclude_input_in_output": opt.exclude_input_in_output,
        "kv_cache_num_blocks": "" if opt.kv_cache_num_blocks is None else opt.kv_cache_num_blocks,
        "kv_cache_memory_bytes": ("" if opt.kv_cache_memory_bytes is None
                                  else opt.kv_cache_memory_bytes),
        "default_temperature": opt.default_temperature,
        "default_top_k": opt.default_top_k,
        "default_top_p": opt.default_top_p,
        "stats_period_ms": opt.stats_period_ms,
        "engine_isolation": opt.engine_isolation,
        "engine_num_threads": opt.engine_num_threads,
        "enable_kv_cache_reuse": opt.enable_kv_cache_reuse and config.kv_cache.enable_prefix_caching,
        "enable_speculative_decoding": (opt.enable_speculative_decoding
                                        and config.speculative.enabled),
        "cuda_graph_mode": opt.cuda_graph_mode,
    }


@dataclass(frozen=True)
class Layout:
    """Which models a repository holds, where each one's templates are, which are Python shims."""

    models: tuple[str, ...]
    overrides: dict          # model -> templates dir (default: model_repository/templates)
    shims: dict              # Python model -> (module in triton_backend.models, class)
    uses_trtllm_values: bool

    def templates_dir(self, model: str) -> Path:
        return self.overrides.get(model, TEMPLATES_DIR)

    def shim(self, model: str):
        return self.shims.get(model)


def layout_for(config: EngineConfig, options: RepositoryOptions) -> Layout:
    if repository_trtllm.backend_for(config, options) == "python":
        return Layout(MODELS, {}, dict(PYTHON_MODELS), uses_trtllm_values=False)
    return Layout(repository_trtllm.MODELS, dict.fromkeys(repository_trtllm.NVIDIA_MODELS,
                                                          repository_trtllm.TEMPLATES_DIR),
                  {**repository_trtllm.SHIMS, "postprocessing": PYTHON_MODELS["postprocessing"]},
                  uses_trtllm_values=True)


def _template_files(model: str, templates_dir: Path = TEMPLATES_DIR) -> list[Path]:
    root = templates_dir / model
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if (root / "config.pbtxt") not in files:
        raise FileNotFoundError(f"{root}: template config.pbtxt missing")
    return files


def emit_repository(engine_dir: Path, output_dir: Path,
                    options: RepositoryOptions | None = None,
                    serving: "ServingSpec | None" = None) -> Path:
    """Write the models for the engine in `engine_dir` into `output_dir`; return it (five models;
    four over NVIDIA's C++ backend for a trtllm engine, see builder/repository/trtllm.py).
    `serving`: the spec's `serving:` section (None: its defaults).

    Renders every template first and writes only when all rendered (a failing render leaves an
    existing repository untouched). Our five model directories are replaced; anything else in
    `output_dir` is left alone.
    """
    engine_dir, output_dir = Path(engine_dir), Path(output_dir)
    options = options or RepositoryOptions()
    config = EngineConfig.load(engine_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    values = template_values(config, engine_dir, output_dir, options, serving)
    layout = layout_for(config, options)
    if layout.uses_trtllm_values:
        repository_device.check_unused(options)
        values.update(repository_trtllm.template_values(config, engine_dir, options))
    rendered: dict[Path, str] = {}
    for model in layout.models:
        for template in _template_files(model, layout.templates_dir(model)):
            relative = Path(model) / template.relative_to(layout.templates_dir(model) / model)
            text = template.read_text()
            # Each template takes the values it names; render() fails on any other placeholder.
            wanted = {k: v for k, v in values.items() if "${" + k + "}" in text}
            rendered[relative] = render(text, wanted, source=str(relative))
        if layout.shim(model) is not None:
            module, class_name = layout.shim(model)
            rendered[Path(model) / "1" / "model.py"] = render(
                (TEMPLATES_DIR / SHIM_TEMPLATE).read_text(),
                {"model_name": model, "module": module, "class_name": class_name},
                source=SHIM_TEMPLATE)
    # Written into a staging directory first, then each model swapped in by a rename.
    staging = Path(tempfile.mkdtemp(prefix=".models.", suffix=".partial", dir=output_dir))
    try:
        for model in layout.models:  # every model needs its version directory
            (staging / model / "1").mkdir(parents=True)
        for relative, text in rendered.items():
            (staging / relative).write_text(text)
        for model in MODELS:
            if model not in layout.models:
                shutil.rmtree(output_dir / model, ignore_errors=True)
        for model in layout.models:
            swap_in(staging / model, output_dir / model)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir

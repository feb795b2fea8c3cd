"""Emit the Triton model repository for an engine: ensemble + preprocessing + tensorrt_llm +
postprocessing + tensorrt_llm_bls, rendered from `model_repository/templates/`.

The repository is self-describing: the engine, tokenizer and `triton_backend` locations are
model parameters, written relative to the repository directory when the two share a parent
directory (so the pair can be moved or mounted together into NVIDIA's Triton container), absolute
otherwise. Everything a user may tune comes from `RepositoryOptions`; everything else comes from
the engine's `config.json`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from builder.install import swap_in
from builder.template import render
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.numbers import is_int
from triton_backend.engine.process.executor import ENGINE_ISOLATIONS
from triton_backend.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from builder.spec import ServingSpec

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "model_repository" / "templates"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
# The Python models share one shim template (`1/model.py`): model -> (module, class) it loads.
PYTHON_MODELS = {"preprocessing": ("preprocessing", "PreprocessingModel"),
                 "tensorrt_llm": ("tensorrt_llm", "TensorrtLlmModel"),
                 "postprocessing": ("postprocessing", "PostprocessingModel"),
                 "tensorrt_llm_bls": ("tensorrt_llm_bls", "BlsModel")}
SHIM_TEMPLATE = "python_model.py.tmpl"
PROJECT_ROOT = Path(__file__).resolve().parent.parent  # holds the triton_backend package


def _int_at_least(name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"repository.{name} must be an integer >= {low}, got {value!r}")


@dataclass
class RepositoryOptions:
    """What a user may tune in the emitted repository (the build spec's `repository:` section).

    `triton_max_batch_size` None means the engine's `limits.max_batch_size`. `max_queue_size` 0
    means no queue limit (Triton's meaning). `engine_isolation` "process" runs the engine in a
    process of its own (see `triton_backend.engine.process.main`); `engine_num_threads` 0 gives
    it every core the server may use. KV budget: at most one of `kv_cache_num_blocks` and
    `kv_cache_memory_bytes`; neither means the engine's own `kv_cache` section decides. The
    `default_*` sampling values apply to requests that do not set them (greedy by default).
    """

    triton_max_batch_size: int | None = None
    preprocessing_instance_count: int = 1
    tensorrt_llm_instance_count: int = 1
    postprocessing_instance_count: int = 1
    bls_instance_count: int = 1
    bls_max_concurrent_requests: int = 64
    max_queue_size: int = 0
    max_queue_delay_microseconds: int = 0
    decoupled: bool = True
    kv_cache_num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    exclude_input_in_output: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    default_temperature: float = 0.0
    default_top_k: int = 0
    default_top_p: float = 1.0
    stats_period_ms: int = 100
    engine_isolation: str = "process"
    engine_num_threads: int = 0
    # trtllm engines (see builder/repository_trtllm.py): `auto` = NVIDIA's C++ backend for trtllm
    # engines, our Python model for the others.
    tensorrt_llm_backend: str = "auto"
    kv_cache_free_gpu_mem_fraction: float | None = None  # None: the hardware profile's
    batch_scheduler_policy: str = "guaranteed_no_evict"
    # Off switches (true: as the engine's config.json says). enable_kv_cache_reuse is NVIDIA's name
    # for prefix caching and serves both targets.
    enable_kv_cache_reuse: bool = True
    enable_speculative_decoding: bool = True
    enable_chunked_context: bool = True
    trtllm_engine_path: str | None = None  # gpt_model_path as the server sees it (None: absolute)

    def __post_init__(self) -> None:
        if self.triton_max_batch_size is not None:
            _int_at_least("triton_max_batch_size", self.triton_max_batch_size, 1)
        for name in ("preprocessing_instance_count", "tensorrt_llm_instance_count",
                     "postprocessing_instance_count", "bls_instance_count",
                     "bls_max_concurrent_requests", "stats_period_ms"):
            _int_at_least(name, getattr(self, name), 1)
        for name in ("max_queue_size", "max_queue_delay_microseconds"):
            _int_at_least(name, getattr(self, name), 0)
        for name in ("decoupled", "exclude_input_in_output", "add_special_tokens",
                     "skip_special_tokens", "enable_speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"repository.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if self.engine_isolation not in ENGINE_ISOLATIONS:
            raise ValueError(f"repository.engine_isolation must be one of "
                             f"{', '.join(ENGINE_ISOLATIONS)}, got {self.engine_isolation!r}")
        _int_at_least("engine_num_threads", self.engine_num_threads, 0)
        if self.kv_cache_num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("repository: give kv_cache_num_blocks or kv_cache_memory_bytes, "
                             "not both")
        for name in ("kv_cache_num_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 1)
        try:
            SamplingParams(temperature=self.default_temperature, top_k=self.default_top_k,
                           top_p=self.default_top_p)
        except ValueError as exc:
            raise ValueError(f"repository.default_{exc}") from None
        from builder.repository_trtllm import check_trtllm_options

        check_trtllm_options(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "RepositoryOptions":
        """Build from a spec section; unknown keys are errors naming the key."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"repository: unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)


def portable_path(target: Path, repository_dir: Path) -> str:
    """`target` relative to `repository_dir` when they share a parent below `/`, else absolute."""
    target, repository_dir = target.resolve(), repository_dir.resolve()
    common = Path(os.path.commonpath([target, repository_dir]))
    if common == Path(common.anchor):
        return str(target)
    return os.path.relpath(target, repository_dir)


def serving_values(config: EngineConfig, serving: "ServingSpec | None" = None) -> dict:
    """The `tensorrt_llm` model's admission and priority parameters (the spec's `serving:`)."""
    from builder.spec import ServingSpec

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
    }


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
    four over NVIDIA's C++ backend for a trtllm engine, see builder/repository_trtllm.py).
    `serving`: the spec's `serving:` section (None: its defaults).

    Renders every template first and writes only when all rendered (a failing render leaves an
    existing repository untouched). Our five model directories are replaced; anything else in
    `output_dir` is left alone.
    """
    from builder import repository_trtllm

    engine_dir, output_dir = Path(engine_dir), Path(output_dir)
    options = options or RepositoryOptions()
    config = EngineConfig.load(engine_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    values = template_values(config, engine_dir, output_dir, options, serving)
    layout = repository_trtllm.layout(config, options)  # {model: (templates dir, shim or None)}
    if layout.uses_trtllm_values:
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

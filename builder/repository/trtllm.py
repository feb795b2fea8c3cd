"""The repository for a trtllm engine: which models, from which templates, with which values.

`tensorrt_llm_backend` chooses the `tensorrt_llm` model:
- `tensorrtllm` (the default for trtllm engines): NVIDIA's C++ backend from
  `model_repository/templates_trtllm/`, with our preprocessing (plus the end id the C++ backend
  needs), postprocessing and an ensemble wired to NVIDIA's outputs. Our `tensorrt_llm_bls` is not
  emitted: it reads outputs only our Python model returns (`finish_reason`, ...).
- `python`: our Python `tensorrt_llm` model (all five models, as for a torch engine). For trtllm
  engines that needs an executor over `tensorrt_llm.bindings.executor.Executor` with our verbs,
  which is not written yet: the option is refused for trtllm engines rather than emitted broken.
"""
from __future__ import annotations

from pathlib import Path

from builder.repository.template import Raw, pbtxt_escape
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.numbers import is_number

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "templates_trtllm"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble")
NVIDIA_MODELS = ("preprocessing", "tensorrt_llm", "ensemble")  # from TEMPLATES_DIR, not ours
SHIMS = {"preprocessing": ("trtllm_preprocessing", "TrtllmPreprocessingModel")}  # + ours
BACKENDS = ("auto", "tensorrtllm", "python")
SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")  # NVIDIA's batch_scheduler_policy
ENGINE_SUBDIR = "trtllm_engine"


def check_trtllm_options(options) -> None:
    """Validate the trtllm fields of RepositoryOptions (errors name the field and the limit)."""
    if options.tensorrt_llm_backend not in BACKENDS:
        raise ValueError(f"repository.tensorrt_llm_backend must be one of {list(BACKENDS)}, "
                         f"got {options.tensorrt_llm_backend!r}")
    fraction = options.kv_cache_free_gpu_mem_fraction
    if fraction is not None and (not is_number(fraction)
                                 or not 0 < fraction < 1):
        raise ValueError(f"repository.kv_cache_free_gpu_mem_fraction must be in (0, 1), "
                         f"got {fraction!r}")
    if options.batch_scheduler_policy not in SCHEDULER_POLICIES:
        raise ValueError(f"repository.batch_scheduler_policy must be one of "
                         f"{list(SCHEDULER_POLICIES)}, got {options.batch_scheduler_policy!r}")
    for name in ("enable_kv_cache_reuse", "enable_chunked_context"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"repository.{name} must be true or false, got "
                             f"{getattr(options, name)!r}")


def backend_for(config: EngineConfig, options) -> str:
    """`tensorrtllm` or `python` for this engine; refuses the C++ backend for our own engines."""
    backend = options.tensorrt_llm_backend
    if backend == "auto":
        return "tensorrtllm" if config.target == "trtllm" else "python"
    if backend == "tensorrtllm" and config.target != "trtllm":
        raise ValueError(f"repository.tensorrt_llm_backend: 'tensorrtllm' serves trtllm engines "
                         f"only; this engine's target is {config.target!r}")
    if backend == "python" and config.target == "trtllm":
        raise ValueError("repository.tensorrt_llm_backend: 'python' over TensorRT-LLM's executor "
                         "is not built yet; trtllm engines are served by 'tensorrtllm'")
    return backend


def template_values(config: EngineConfig, engine_dir: Path, options) -> dict[str, object]:
    """The values only the C++ `tensorrt_llm` template takes, from the engine's trtllm section."""
    trtllm = config.extra.get("trtllm")
    if not trtllm:
        raise ValueError(f"{engine_dir}: config.json has no trtllm section (not a trtllm engine)")
    fraction = options.kv_cache_free_gpu_mem_fraction or trtllm["kv_cache_free_gpu_mem_fraction"]
    # KV reuse and chunked context need paged context FMHA in the engine (see builder/trtllm/build.py).
    paged_context = bool(trtllm["plugins"]["use_paged_context_fmha"])
    optional = []
    if options.kv_cache_num_blocks is not None:
        optional.append(("max_tokens_in_paged_kv_cache",
                         options.kv_cache_num_blocks * config.kv_cache.tokens_per_block))
    if trtllm.get("max_attention_window"):  # local layers' windows (Gemma 3), one per layer
        optional.append(("max_attention_window_size",
                         ",".join(str(w) for w in trtllm["max_attention_window"])))
    return {
        "gpt_model_path": options.trtllm_engine_path or str((Path(engine_dir) / ENGINE_SUBDIR).resolve()),
        "batch_scheduler_policy": options.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": fraction,
        "enable_kv_cache_reuse": (options.enable_kv_cache_reuse and paged_context
                                  and config.kv_cache.enable_prefix_caching),
        "enable_chunked_context": options.enable_chunked_context and paged_context,
        "optional_parameters": Raw("\n".join(
            f'parameters {{ key: "{pbtxt_escape(key)}" value: {{ string_value: '
            f'"{pbtxt_escape(str(value))}" }} }}' for key, value in optional)),
    }

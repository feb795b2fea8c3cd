"""Where the repository's `tensorrt_llm` model runs a torch engine: its Triton instance group, the
device parameters it is emitted with, and the check `forge serve` makes before it starts.

`repository.tensorrt_llm_instance_kind` (the spec's `repository:` section, or `forge repository`):
- `auto` (the default): KIND_GPU for a GPU engine, KIND_CPU for a CPU engine.
- `gpu`: KIND_GPU. Triton makes the instances on every GPU it sees and gives each its device id,
  which the model runs its engine on: how NVIDIA's Triton container runs GPU models. The
  `tritonserver` of the nvidia-pytriton wheel (2.51) does the same: it is built with GPU support
  (it links CUDA 12.6's runtime and DCGM, and has the CUDA memory-pool options); without a GPU it
  refuses the instance with "has kind KIND_GPU but no GPUs are available".
- `model`: KIND_MODEL, the device from the model parameter `gpu_device_ids` (NVIDIA's name: one
  id, or one per instance separated by `;`; unset: the current CUDA device). For a tritonserver
  built without GPU support, which refuses KIND_GPU outright, or to place instances by hand.

The choice is made when the repository is emitted, not when it is served: the repository is what
tritonserver reads, in a pod from a read-only image or volume, and `forge serve` never rewrites
it. `forge serve` refuses a GPU engine where no CUDA device is visible, before any port opens.
preprocessing, postprocessing and the BLS move text and ids and stay KIND_CPU.
"""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.config import EngineConfig
from triton_backend.models.instance_device import check_instance_count, parse_gpu_device_ids

INSTANCE_KINDS = ("auto", "gpu", "model")
TRITON_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU", "model": "KIND_MODEL"}


def _is_gpu(hardware: str) -> bool:
    from builder.spec.torch_gpu import is_gpu_engine

    return is_gpu_engine(hardware)


def _check_kind_name(kind: object) -> None:
    if kind not in INSTANCE_KINDS:
        raise ValueError(f"repository.tensorrt_llm_instance_kind must be one of "
                         f"{list(INSTANCE_KINDS)}, got {kind!r}")


def check_instance_kind(kind: object, hardware: str) -> None:
    """`gpu` and `model` place a GPU engine; a CPU engine's instance is KIND_CPU."""
    _check_kind_name(kind)
    if kind != "auto" and not _is_gpu(hardware):
        raise ValueError(f"repository.tensorrt_llm_instance_kind: {kind!r} places a GPU engine; "
                         f"this engine's hardware is {hardware} (use auto)")


def check_instance_options(options) -> None:
    """The instance fields of RepositoryOptions on their own (errors name the field)."""
    _check_kind_name(options.tensorrt_llm_instance_kind)
    ids = options.gpu_device_ids
    if ids is None:
        return
    if options.tensorrt_llm_instance_kind != "model":
        raise ValueError("repository.gpu_device_ids: only with tensorrt_llm_instance_kind model "
                         "(KIND_GPU instances take the device Triton gives them)")
    if isinstance(ids, bool) or not isinstance(ids, (int, str)):
        raise ValueError(f"repository.gpu_device_ids: a device id or ids separated by ';', "
                         f"got {ids!r}")
    try:
        check_instance_count(parse_gpu_device_ids(str(ids)),
                             options.tensorrt_llm_instance_count)
    except ValueError as exc:
        raise ValueError(f"repository.{exc}") from None


def template_values(config: EngineConfig, options) -> dict[str, object]:
    """The `tensorrt_llm` template's instance kind and device parameters for this engine."""
    check_instance_kind(options.tensorrt_llm_instance_kind, config.hardware)
    kind = options.tensorrt_llm_instance_kind
    if kind == "auto":
        kind = "gpu" if _is_gpu(config.hardware) else "cpu"
    fraction = options.kv_cache_free_gpu_mem_fraction or config.kv_cache.free_gpu_mem_fraction
    return {"tensorrt_llm_instance_kind": TRITON_KINDS[kind],
            "gpu_device_ids": "" if options.gpu_device_ids is None else options.gpu_device_ids,
            "kv_cache_free_gpu_mem_fraction": "" if fraction is None else fraction}


def check_unused(options) -> None:
    """NVIDIA's C++ backend (trtllm engines) places its executors itself: our instance options
    would be silently ignored there, so they are refused."""
    if options.tensorrt_llm_instance_kind != "auto" or options.gpu_device_ids is not None:
        raise ValueError("repository.tensorrt_llm_instance_kind / gpu_device_ids: for the torch "
                         "target's Python model; NVIDIA's tensorrtllm backend places a trtllm "
                         "engine itself")


def check_servable(repository_dir: Path) -> None:
    """Before `forge serve` opens a port: a torch GPU engine needs a visible CUDA device, and
    the ids of a KIND_MODEL instance's `gpu_device_ids` must exist. ValueError with one line.

    A repository whose engine cannot be read here is left to the server to report."""
    from builder.repository.target import repository_parameters, served_engine
    from builder.spec.torch_gpu import gpu_unavailable

    from google.protobuf.text_format import ParseError

    try:
        engine = served_engine(repository_dir)
        config = EngineConfig.load(engine) if engine is not None else None
    except (OSError, ValueError, ParseError):
        return
    if engine is None or config is None:
        return
    if config.target != "torch":
        return
    problem = gpu_unavailable(engine, config.hardware)
    if problem:
        raise ValueError(f"{problem}: serve it on a GPU host (or build it for hardware cpu)")
    if not _is_gpu(config.hardware):
        return
    ids = parse_gpu_device_ids(repository_parameters(repository_dir, "tensorrt_llm")
                               .get("gpu_device_ids", ""))
    import torch

    visible = torch.cuda.device_count()
    missing = sorted(i for i in set(ids) if i >= visible)
    if missing:
        raise ValueError(f"repository {repository_dir}: tensorrt_llm's gpu_device_ids names CUDA "
                         f"device {missing[0]}; {visible} are visible here")

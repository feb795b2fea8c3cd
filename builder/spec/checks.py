"""What one section of a build spec means for another, checked once the sections are read (the
quantizer's and the gate's options, the repository's, the target on its hardware, adapters,
deployment). Every error is a `SpecError` naming the key."""
from __future__ import annotations

from builder.spec import torch_gpu
from builder.spec.build_spec import BuildSpec, QuantizationSpec, SpecError, section_error
from builder.spec.hardware import ANY_GPU, FP8_PROFILES, GPU_PROFILES, PROFILES

TRTLLM_DTYPES = ("bfloat16", "float16")  # TensorRT-LLM's GEMM/attention plugins run in 16 bits


def check_spec(spec: BuildSpec) -> None:
    check_quantization(spec.quantization)
    check_repository(spec.repository, spec.target)
    if spec.lora is not None and spec.target == "naive":
        raise SpecError("lora: the naive target (transformers generate) serves no adapters; "
                        "use target torch")
    if spec.target == "trtllm":
        _check_trtllm(spec)
    else:
        _check_torch_target(spec)
    if spec.deployment is not None:
        try:
            spec.deployment.check_against(spec.name, spec.target, spec.parallelism.world_size)
        except ValueError as exc:
            raise SpecError(str(exc)) from None


def check_quantization(section: QuantizationSpec) -> None:
    """The quantizer's and the gate's own validation, so a bad field fails before any work."""
    from builder.quality.metrics import QualityThresholds
    from builder.quantize.options import QuantizeOptions

    try:
        QuantizeOptions.from_spec(section)
        QualityThresholds.from_spec(section.quality)
    except (TypeError, ValueError) as exc:
        raise section_error("quantization", exc) from None


def check_repository(raw: object, target: str) -> None:
    from builder.repository.options import RepositoryOptions

    if not isinstance(raw, dict):
        raise SpecError("repository: must be a mapping")
    try:
        RepositoryOptions.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise section_error("repository", exc) from None
    if raw.get("tensorrt_llm_backend") == "tensorrtllm" and target != "trtllm":
        raise SpecError("repository.tensorrt_llm_backend: 'tensorrtllm' (NVIDIA's C++ backend) "
                        f"serves trtllm engines only; target is {target!r}")


def _check_torch_target(spec: BuildSpec) -> None:
    """torch (and naive) on the CPU or, torch only, on a GPU (torch_gpu.py)."""
    from builder.repository.device import check_instance_kind

    try:
        if PROFILES[spec.hardware].is_gpu:
            torch_gpu.check_gpu_spec(spec)
        else:
            if spec.parallelism.world_size != 1 or spec.parallelism.moe_set:
                raise ValueError(f"parallelism: tp/pp are TensorRT-LLM's (target trtllm); "
                                 f"target {spec.target} runs on one device (tp: 1, pp: 1)")
            torch_gpu.check_cpu_spec(spec)
        check_instance_kind(spec.repository.get("tensorrt_llm_instance_kind", "auto"),
                            spec.hardware)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _check_trtllm(spec: BuildSpec) -> None:
    """What the GPU cannot do fails here, naming the field and why."""
    if spec.hardware not in GPU_PROFILES:
        any_gpu = (f" ({ANY_GPU}, any CUDA GPU, is for target torch: trtllm-build needs the "
                   f"GPU's SM and memory)" if spec.hardware == ANY_GPU else "")
        raise SpecError(f"hardware: target trtllm needs a GPU profile {list(GPU_PROFILES)}, "
                        f"got {spec.hardware!r}{any_gpu}")
    if spec.dtype not in TRTLLM_DTYPES:
        raise SpecError(f"dtype: target trtllm builds {list(TRTLLM_DTYPES)} engines, "
                        f"got {spec.dtype!r}")
    if spec.speculative.enabled:
        raise SpecError(f"speculative.mode: {spec.speculative.mode!r} runs on the torch target; "
                        f"TensorRT-LLM's speculative decoding is not wired up (use mode: none)")
    if spec.quantization.zero_point:
        raise SpecError("quantization.zero_point: the trtllm target's INT4 (W4A16_AWQ) is "
                        "symmetric; zero-point INT4 runs on the torch target")
    if spec.quantization.lm_head != "none":
        raise SpecError(f"quantization.lm_head: {spec.quantization.lm_head!r} runs on the "
                        f"torch target's CPU kernels; use none for trtllm")
    profile = PROFILES[spec.hardware]
    for key in ("weights", "kv_cache"):
        if getattr(spec.quantization, key) == "fp8" and not profile.fp8:
            raise SpecError(f"quantization.{key}: fp8 needs FP8 tensor cores (SM >= 89: "
                            f"{', '.join(FP8_PROFILES)}); {spec.hardware} is SM {profile.sm}")

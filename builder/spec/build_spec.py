"""The build spec: one YAML file that says what to build. Validated field by field.

Unknown keys and bad values raise `SpecError` (a ValueError) naming the key, e.g.
`limits.max_batch_size: must be an integer >= 1, got 0`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from builder.spec.deployment import DeploymentSpec, check_keys
from builder.spec.hardware import ANY_GPU, FP8_PROFILES, GPU_PROFILES, PROFILES
from builder.pipeline.lora import LoraSpec
from triton_backend.engine.config import DTYPES, KVCacheConfig, Limits, SpeculativeConfig
from triton_backend.engine.numbers import is_int, is_number

TARGETS_BUILT = ("torch", "naive", "trtllm")
HARDWARE_PROFILES = tuple(PROFILES)
TRTLLM_DTYPES = ("bfloat16", "float16")  # TensorRT-LLM's GEMM/attention plugins run in 16 bits
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


class SpecError(ValueError):
    """A build spec problem; the message names the key."""


def parse_bytes(key: str, value: Any) -> int:
    """`1073741824`, `"1GiB"`, `"512 MB"` -> bytes."""
    if is_int(value):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecError(f"{key}: expected bytes like 1073741824 or '1GiB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class QuantizationSpec:
    weights: str = "none"
    kv_cache: str = "none"
    group_size: int = 128
    exclude_modules: list[str] = field(default_factory=lambda: ["lm_head"])
    calibration: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)
    zero_point: bool = False
    lm_head: str = "none"

    def __post_init__(self) -> None:
        # The quantizer's and the gate's own validation, so a bad field fails before any work.
        from builder.quality.gate import QualityThresholds
        from builder.quantize import QuantizeOptions

        try:
            QuantizeOptions.from_spec(self)
            QualityThresholds.from_spec(self.quality)
        except (TypeError, ValueError) as exc:
            message = str(exc)
            raise SpecError(message if message.startswith("quantization")
                            else f"quantization: {message}") from None


@dataclass
class ParallelismSpec:
    """TensorRT-LLM's tensor (`tp`) and pipeline (`pp`) parallelism: tp * pp GPUs, one rank each."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise SpecError(f"parallelism.{key}: must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


@dataclass
class ServingSpec:
    """Overload behaviour of the served model (the `tensorrt_llm` model's parameters).

    Admission: a request that would make more than `max_waiting_requests` requests, or more than
    `max_waiting_prompt_tokens` prompt tokens, wait to be scheduled is refused at once with
    "server busy" (0 = unbounded). `max_waiting_prompt_tokens` None: 8 x the engine's
    max_num_tokens (eight full prefill steps), at least its max_input_len.
    Priorities: a waiting request gains `priority_aging_rate` priority levels per second, so a
    priority p request counts as having arrived p / rate seconds earlier.
    """

    max_waiting_requests: int = 64
    max_waiting_prompt_tokens: int | None = None
    priority_aging_rate: float = 1.0

    def __post_init__(self) -> None:
        for key in ("max_waiting_requests", "max_waiting_prompt_tokens"):
            value = getattr(self, key)
            if value is None and key == "max_waiting_prompt_tokens":
                continue
            if not is_int(value) or value < 0:
                raise SpecError(f"serving.{key} must be an integer >= 0 (0: unbounded), "
                                f"got {value!r}")
        rate = self.priority_aging_rate
        if not is_number(rate) or not 0 < rate <= 1e6:
            raise SpecError(f"serving.priority_aging_rate must be a number of priority levels "
                            f"per second in (0, 1000000], got {rate!r}")

    def waiting_prompt_tokens(self, limits: Limits) -> int:
        """The bound on waiting prompt tokens for an engine with these limits."""
        if self.max_waiting_prompt_tokens is not None:
            return self.max_waiting_prompt_tokens
        return max(limits.max_input_len, 8 * limits.max_num_tokens)


@dataclass
class BuildSpec:
    name: str
    checkpoint: str
    target: str = "torch"
    dtype: str = "bfloat16"
    hardware: str = "cpu"
    output: str | None = None
    limits: Limits | None = None  # None: derived from the model (see default_limits)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    repository: dict = field(default_factory=dict)
    serving: ServingSpec = field(default_factory=ServingSpec)
    lora: LoraSpec | None = None  # None: no adapters (see builder/pipeline/lora.py)
    deployment: DeploymentSpec | None = None  # None: forge deploy refuses (builder/spec/deployment.py)
    source: Path | None = None  # the YAML file this spec came from

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(self.name)):
            raise SpecError(f"name: letters, digits, '.', '_' and '-' only, got {self.name!r}")
        if self.target not in TARGETS_BUILT:
            raise SpecError(f"target: must be one of {list(TARGETS_BUILT)}, got {self.target!r}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype: must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.hardware not in HARDWARE_PROFILES:
            raise SpecError(f"hardware: must be one of {list(HARDWARE_PROFILES)}, got {self.hardware!r}")
        if self.lora is not None and self.target == "naive":
            raise SpecError("lora: the naive target (transformers generate) serves no adapters; "
                            "use target torch")
        if self.target == "trtllm":
            self._check_trtllm()
        else:
            self._check_torch_target()
        if self.deployment is not None:
            try:
                self.deployment.check_against(self.name, self.target, self.parallelism.world_size)
            except ValueError as exc:
                raise SpecError(str(exc)) from None

    def _check_torch_target(self) -> None:
        """torch (and naive) on the CPU or, torch only, on a GPU (builder/spec/torch_gpu.py)."""
        from builder.spec import torch_gpu
        from builder.repository.device import check_instance_kind

        try:
            if PROFILES[self.hardware].is_gpu:
                torch_gpu.check_gpu_spec(self)
            else:
                if self.parallelism.world_size != 1:
                    raise ValueError(f"parallelism: tp/pp are TensorRT-LLM's (target trtllm); "
                                     f"target {self.target} runs on one device (tp: 1, pp: 1)")
                torch_gpu.check_cpu_spec(self)
            check_instance_kind(self.repository.get("tensorrt_llm_instance_kind", "auto"),
                                self.hardware)
        except ValueError as exc:
            raise SpecError(str(exc)) from None

    def _check_trtllm(self) -> None:
        """What the GPU cannot do fails here, naming the field and why."""
        if self.hardware not in GPU_PROFILES:
            any_gpu = (f" ({ANY_GPU}, any CUDA GPU, is for target torch: trtllm-build needs the "
                       f"GPU's SM and memory)" if self.hardware == ANY_GPU else "")
            raise SpecError(f"hardware: target trtllm needs a GPU profile {list(GPU_PROFILES)}, "
                            f"got {self.hardware!r}{any_gpu}")
        if self.dtype not in TRTLLM_DTYPES:
            raise SpecError(f"dtype: target trtllm builds {list(TRTLLM_DTYPES)} engines, "
                            f"got {self.dtype!r}")
        if self.speculative.enabled:
            raise SpecError(f"speculative.mode: {self.speculative.mode!r} runs on the torch target; "
                            f"TensorRT-LLM's speculative decoding is not wired up (use mode: none)")
        if self.quantization.zero_point:
            raise SpecError("quantization.zero_point: the trtllm target's INT4 (W4A16_AWQ) is "
                            "symmetric; zero-point INT4 runs on the torch target")
        if self.quantization.lm_head != "none":
            raise SpecError(f"quantization.lm_head: {self.quantization.lm_head!r} runs on the "
                            f"torch target's CPU kernels; use none for trtllm")
        profile = PROFILES[self.hardware]
        for key in ("weights", "kv_cache"):
            if getattr(self.quantization, key) == "fp8" and not profile.fp8:
                raise SpecError(f"quantization.{key}: fp8 needs FP8 tensor cores (SM >= 89: "
                                f"{', '.join(FP8_PROFILES)}); {self.hardware} is SM {profile.sm}")

    @property
    def output_dir(self) -> Path:
        return Path(self.output) if self.output else Path("engines") / self.name


def default_limits(max_position_embeddings: int) -> Limits:
    """Limits for a spec that sets none: the model's context (up to 4096), half of it for input."""
    max_seq_len = min(4096, max_position_embeddings)
    return Limits(max_batch_size=16, max_num_tokens=min(2048, max_seq_len),
                  max_input_len=max_seq_len // 2, max_seq_len=max_seq_len)


_SECTIONS = {"limits": Limits, "kv_cache": KVCacheConfig, "quantization": QuantizationSpec,
             "parallelism": ParallelismSpec, "speculative": SpeculativeConfig,
             "serving": ServingSpec, "lora": LoraSpec, "deployment": DeploymentSpec}


def _build_section(key: str, klass: type, raw: Any) -> Any:
    try:
        raw = dict(check_keys(key, klass, raw))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if key == "kv_cache" and raw.get("memory_bytes") is not None:
        raw["memory_bytes"] = parse_bytes("kv_cache.memory_bytes", raw["memory_bytes"])
    try:
        return klass(**raw)
    except SpecError:
        raise
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise SpecError(message if message.startswith(f"{key}.") or message.startswith(f"{key}:")
                        else f"{key}: {message}") from None


def _check_repository(raw: Any) -> None:
    from builder.repository.options import RepositoryOptions

    if not isinstance(raw, dict):
        raise SpecError("repository: must be a mapping")
    try:
        RepositoryOptions.from_dict(raw)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise SpecError(message if message.startswith("repository") else f"repository: {message}") \
            from None


def spec_from_dict(data: dict, source: Path | None = None) -> BuildSpec:
    if not isinstance(data, dict):
        raise SpecError("spec: the top level must be a mapping")
    known = {f.name for f in dataclasses.fields(BuildSpec)} - {"source"}
    for key in data:
        if key not in known:
            raise SpecError(f"{key}: unknown key (known: {sorted(known)})")
    for key in ("name", "checkpoint"):
        if not data.get(key):
            raise SpecError(f"{key}: required")
    kwargs = dict(data)
    for key, klass in _SECTIONS.items():
        if key in kwargs:
            kwargs[key] = _build_section(key, klass, kwargs[key] or {})
    if "repository" in kwargs:
        _check_repository(kwargs["repository"])
        backend = kwargs["repository"].get("tensorrt_llm_backend")
        if backend == "tensorrtllm" and kwargs.get("target") != "trtllm":
            raise SpecError("repository.tensorrt_llm_backend: 'tensorrtllm' (NVIDIA's C++ backend) "
                            f"serves trtllm engines only; target is {kwargs.get('target', 'torch')!r}")
    if kwargs.get("lora") is not None and source is not None:
        # relative adapter paths are relative to the spec's directory, whatever the cwd
        lora = kwargs["lora"]
        lora.adapters = {name: os.path.normpath(path) for name, path
                         in lora.adapter_dirs(Path(source).resolve().parent).items()}
    return BuildSpec(source=source, **kwargs)


def load_spec(path: str | Path, overrides: dict | None = None,
              quantization_overrides: dict | None = None) -> BuildSpec:
    """Read a YAML spec; `overrides` (from command-line flags) replace top-level keys and
    `quantization_overrides` keys of the `quantization` section (None values are ignored)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    quant = {k: v for k, v in (quantization_overrides or {}).items() if v is not None}
    if quant:
        data["quantization"] = {**(data.get("quantization") or {}), **quant}
    return spec_from_dict(data, source=path)

"""The build spec as plain data: `BuildSpec` and its sections, each field checked on its own
(`SpecError` naming the key, e.g. `limits.max_batch_size: must be an integer >= 1, got 0`).
Checks across sections are `checks.py`'s, reading the YAML `load.py`'s."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.pipeline.lora import LoraSpec
from builder.spec.deployment import DeploymentSpec
from builder.spec.hardware import PROFILES
from triton_backend.engine.config import DTYPES, KVCacheConfig, Limits, SpeculativeConfig
from triton_backend.engine.numbers import is_int, is_number

TARGETS_BUILT = ("torch", "naive", "trtllm")
HARDWARE_PROFILES = tuple(PROFILES)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


class SpecError(ValueError):
    """A build spec problem; the message names the key."""


def section_error(key: str, exc: Exception) -> SpecError:
    """`exc`'s message as a SpecError naming the section `key` (unless it names it already)."""
    message = str(exc)
    return SpecError(message if message.startswith((f"{key}.", f"{key}:")) else f"{key}: {message}")


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
    lm_head: str = "none"  # checked by the quantizer's own options (spec/checks.py)
    rounding: str = "minmax"  # the same



@dataclass
class ParallelismSpec:
    """TensorRT-LLM's tensor (`tp`) and pipeline (`pp`) parallelism: tp * pp GPUs, one rank each.

    A mixture-of-experts layer splits its experts over the same tp ranks as TensorRT-LLM's
    `moe_tp_size` x `moe_ep_size` (`moe_tp` * `moe_ep` == `tp`): `moe_ep` groups of whole experts,
    each expert's intermediate size split `moe_tp` ways. Unset: TensorRT-LLM's default, every
    expert split over all tp ranks (moe_tp = tp, moe_ep = 1); one set: the other is tp / it.
    """

    tp: int = 1
    pp: int = 1
    moe_tp: int | None = None
    moe_ep: int | None = None

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "moe_tp", "moe_ep"):
            value = getattr(self, key)
            if value is None and key.startswith("moe_"):
                continue
            if not is_int(value) or value < 1:
                raise SpecError(f"parallelism.{key}: must be an integer >= 1, got {value!r}")
        for key in ("moe_tp", "moe_ep"):
            value = getattr(self, key)
            if value is not None and self.tp % value:
                raise SpecError(f"parallelism.{key} ({value}) must divide parallelism.tp "
                                f"({self.tp}): moe_tp * moe_ep == tp")
        moe_tp, moe_ep = self.moe_split
        if moe_tp * moe_ep != self.tp:
            raise SpecError(f"parallelism: moe_tp * moe_ep must equal tp, got {moe_tp} * {moe_ep} "
                            f"!= {self.tp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def moe_set(self) -> bool:
        return self.moe_tp is not None or self.moe_ep is not None

    @property
    def moe_split(self) -> tuple[int, int]:
        """(moe_tp, moe_ep), the unset ones resolved."""
        moe_tp, moe_ep = self.moe_tp, self.moe_ep
        if moe_tp is None:
            return self.tp // (moe_ep or 1), moe_ep or 1
        return moe_tp, self.tp // moe_tp if moe_ep is None else moe_ep


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

    @property
    def output_dir(self) -> Path:
        return Path(self.output) if self.output else Path("engines") / self.name


def default_limits(max_position_embeddings: int) -> Limits:
    """Limits for a spec that sets none: the model's context (up to 4096), half of it for input."""
    max_seq_len = min(4096, max_position_embeddings)
    return Limits(max_batch_size=16, max_num_tokens=min(2048, max_seq_len),
                  max_input_len=max_seq_len // 2, max_seq_len=max_seq_len)

"""What to quantize and how: the build spec's `quantization` section, validated and defaulted."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triton_backend.engine.numbers import is_int
from triton_backend.engine.quant import KV_CACHE_MODES, LM_HEAD_MODES, WEIGHT_MODES  # one list for both halves

CALIBRATION_KEYS = ("dataset", "samples", "seq_len", "batch_size")
ROUNDINGS = ("minmax", "search", "activation")


def _positive_int(key: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{key}: must be an integer >= 1, got {value!r}")
    return value


@dataclass
class CalibrationOptions:
    """Calibration text: `builtin` (shipped with llm-forge) or a .txt / .jsonl path."""

    dataset: str = "builtin"
    # 16 x 128 tokens: AWQ's search costs ~11 forward passes per linear per token on a CPU.
    samples: int = 16       # sequences of `seq_len` tokens fed through the model
    seq_len: int = 128
    batch_size: int = 4

    def __post_init__(self) -> None:
        for key in ("samples", "seq_len", "batch_size"):
            _positive_int(f"quantization.calibration.{key}", getattr(self, key))
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"quantization.calibration.dataset: 'builtin' or a path, "
                             f"got {self.dataset!r}")


@dataclass
class QuantizeOptions:
    """One quantization run. `weights`/`kv_cache` name the modes; `exclude_modules` are patterns
    matched against TensorRT-LLM module names (e.g. `lm_head`, `*.mlp.proj`)."""

    weights: str = "none"
    kv_cache: str = "none"
    group_size: int = 128
    exclude_modules: list[str] = field(default_factory=lambda: ["lm_head"])
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    # INT4 with a zero per group (asymmetric round-to-nearest, by llm-forge; only a one-byte
    # kv_cache calibrates): keeps a checkpoint that is itself on such a grid (GGUF Q4_1, GPTQ)
    # as it is. torch target only.
    zero_point: bool = False
    # The LM head in int8 (per column and block of 32 inputs), quantized when the torch runtime
    # loads the engine and multiplied with int8 activations by the CPU kernels.
    lm_head: str = "none"
    # How a zero-point group's grid is chosen: `minmax` (its min and max are the grid's ends),
    # `search` (candidate scales refit by least squares, int4.quantize_search_zero_point) or
    # `activation` (the same, each input column weighted by its RMS activation over the
    # calibration text).
    rounding: str = "minmax"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"quantization.weights: must be one of {list(WEIGHT_MODES)}, "
                             f"got {self.weights!r}")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"quantization.kv_cache: must be one of {list(KV_CACHE_MODES)}, "
                             f"got {self.kv_cache!r}")
        _positive_int("quantization.group_size", self.group_size)
        if self.lm_head not in LM_HEAD_MODES:
            raise ValueError(f"quantization.lm_head: must be one of {list(LM_HEAD_MODES)}, "
                             f"got {self.lm_head!r}")
        if not isinstance(self.zero_point, bool):
            raise ValueError(f"quantization.zero_point: must be true or false, "
                             f"got {self.zero_point!r}")
        if self.zero_point and self.weights != "int4_rtn":
            raise ValueError(f"quantization.zero_point: needs weights int4_rtn (int4_awq and fp8 "
                             f"are symmetric, as TensorRT-LLM runs them), got {self.weights!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"quantization.rounding: must be one of {list(ROUNDINGS)}, "
                             f"got {self.rounding!r}")
        if self.rounding != "minmax" and not self.zero_point:
            raise ValueError(f"quantization.rounding: {self.rounding!r} searches a zero-point "
                             f"grid; it needs zero_point: true")

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.kv_cache != "none"

    @classmethod
    def from_spec(cls, section: Any) -> "QuantizeOptions":
        """From the build spec's `quantization` section (a dataclass or a mapping)."""
        get = section.get if isinstance(section, dict) else lambda k, d=None: getattr(section, k, d)
        calibration = dict(get("calibration") or {})
        unknown = sorted(set(calibration) - set(CALIBRATION_KEYS))
        if unknown:
            raise ValueError(f"quantization.calibration.{unknown[0]}: unknown key "
                             f"(known: {list(CALIBRATION_KEYS)})")
        excludes = get("exclude_modules")
        return cls(weights=get("weights", "none"), kv_cache=get("kv_cache", "none"),
                   group_size=get("group_size", 128),
                   exclude_modules=list(["lm_head"] if excludes is None else excludes),
                   calibration=CalibrationOptions(**calibration),
                   zero_point=get("zero_point", False), lm_head=get("lm_head", "none"),
                   rounding=get("rounding", "minmax"))

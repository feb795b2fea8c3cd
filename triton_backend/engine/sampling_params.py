"""Per-request sampling parameters, validated where they enter the engine.

Every float is bounded so that no request can push a logit to inf or NaN: the sampler divides by
the temperature and the repetition penalty and adds `frequency_penalty * count` (count <= the
sequence length), all of which stay finite in float32 within these bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from triton_backend.engine.numbers import is_int, is_number

# temperature is 0 (greedy) or within [MIN_TEMPERATURE, MAX_TEMPERATURE]: logits / 1e-38 overflow
# to inf, and above 100 sampling is uniform noise (1/temperature has a floor of 0.01).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_ABS_ADDITIVE_PENALTY = 100.0  # presence_penalty and frequency_penalty


def _check_number(name: str, value: float, low: float | None = None, high: float | None = None,
                  low_open: bool = False) -> None:
    if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy; top_k 0 means no top-k cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    beam_width: int = 1

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, low=0.0)
        if self.temperature != 0.0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or within [{MIN_TEMPERATURE}, "
                             f"{MAX_TEMPERATURE}], got {self.temperature!r}")
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_number("repetition_penalty", self.repetition_penalty, low=MIN_REPETITION_PENALTY,
                      high=MAX_REPETITION_PENALTY)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-MAX_ABS_ADDITIVE_PENALTY,
                          high=MAX_ABS_ADDITIVE_PENALTY)
        for name in ("top_k", "min_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.seed is not None and (not is_int(self.seed)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.beam_width != 1:
            raise ValueError(f"beam_width must be 1 (beam search is not supported), got {self.beam_width!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

"""The quality gate's thresholds (the spec's `quantization.quality`) and its report, plain data."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from triton_backend.engine.numbers import is_int, is_number


@dataclass
class QualityThresholds:
    """The spec's `quantization.quality` section. Limits are inclusive; None disables one.

    The defaults suit small models, where 4-bit costs most: on SmolLM2-135M, INT4-AWQ at group 64
    passes the held-out-text ones and round-to-nearest does not; neither keeps 90% of the chat
    answers the source gets right (the task check, docs/quantization.md). Tighten the text
    thresholds for large models.
    """

    max_perplexity_increase_pct: float | None = 35.0
    min_top1_agreement: float | None = 0.65
    min_logit_cosine: float | None = 0.90
    min_greedy_agreement: float | None = None  # reported; gated only when set
    # The task check (task_check.py): of the chat questions the reference answers right, the
    # share the engine answers right too; null reports it without gating.
    min_task_retention: float | None = 0.9
    # A must-keep item (task_check.TaskItem.must_keep: the README's demo question) that the
    # reference answers right and the engine does not fails the gate; false reports it only.
    must_keep: bool = True
    quick: bool = False       # a fraction of the evaluation, reported as such (not the full gate)
    task_tokens: int = 24            # greedy tokens of each answer
    task_agreement_tokens: int = 8   # first tokens compared for the greedy agreement
    dataset: str = "builtin:heldout"
    windows: int = 8          # held-out windows of `seq_len` tokens
    seq_len: int = 128
    prompts: int = 8          # greedy prompts (the first `prompt_len` tokens of windows)
    prompt_len: int = 32
    greedy_tokens: int = 16
    enabled: bool = True      # false: `forge engine` builds without the gate (and says so)

    def __post_init__(self) -> None:
        for name in ("must_keep", "quick", "enabled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"quantization.quality.{name}: true or false, "
                                 f"got {getattr(self, name)!r}")
        for name in ("max_perplexity_increase_pct", "min_top1_agreement", "min_logit_cosine",
                     "min_greedy_agreement", "min_task_retention"):
            value = getattr(self, name)
            if value is not None and (not is_number(value)):
                raise ValueError(f"quantization.quality.{name}: a number or null, got {value!r}")
        for name in ("windows", "seq_len", "prompts", "prompt_len", "greedy_tokens",
                     "task_tokens", "task_agreement_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"quantization.quality.{name}: an integer >= 1, got {value!r}")

    @classmethod
    def from_spec(cls, section: dict | None) -> "QualityThresholds":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in section or {}:
            if key not in known:
                raise ValueError(f"quantization.quality.{key}: unknown key (known: {sorted(known)})")
        return cls(**(section or {}))


@dataclass
class QualityReport:
    reference_perplexity: float
    engine_perplexity: float
    perplexity_increase_pct: float
    top1_agreement: float
    logit_cosine: float
    greedy_agreement: float
    num_tokens: int
    dataset: str
    reference: str
    failures: list[str] = field(default_factory=list)
    # The task check; None without a chat template (and retention None when the reference
    # answers none of the items: nothing to retain).
    task_engine_score: float | None = None
    task_reference_score: float | None = None
    task_retention: float | None = None
    task_first_tokens_agreement: float | None = None
    task_items: list[dict] = field(default_factory=list)
    # Items whose verdict changed vs the reference (task_check.changed_answers).
    task_changed_answers: list[dict] = field(default_factory=list)
    mode: str = "full"  # "quick": a fraction of the gate (`scope` says which)
    scope: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

"""The quality gate: a quantized engine against its unquantized source, on held-out text.

Metrics (reference = transformers in float32 on the source checkpoint; candidate = the engine):
- `perplexity_increase_pct`: 100 * (ppl_engine / ppl_reference - 1) over the held-out windows;
- `top1_agreement`: share of positions where both predict the same next token;
- `logit_cosine`: mean cosine similarity of the two logit vectors per position;
- `greedy_agreement`: per prompt, the share of a greedy continuation generated before the engine
  first departs from the reference (the engine decodes through its own, possibly quantized, KV
  cache), averaged over the prompts.

The held-out text is never the calibration text (builder/data keeps the two files disjoint).
The task check (task_check.py) adds chat questions: retention, every answer that changed, and
the must-keep items whose loss fails the gate alone.
`run_quality_gate` writes `quality.json` into the engine and raises `QualityGateError` naming the
metric and its threshold when one is crossed (`forge` exits with code 3).

`quick: true` (`forge engine --quick-gate`) measures a fraction of it for trying things out; its
report, verdict line and `quality.json` (`"mode": "quick"`) say so, and the spec (hence the build
key) differs, so a later build without it rebuilds and runs the full gate.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from builder.errors import QualityGateError
from builder.pipeline.progress import Eta
from builder.quality.metrics import QualityReport, QualityThresholds
from builder.quality.report import (QUICK_NOTE, format_table, plan_line, record_gate_time,
                                    short, verdict)
from builder.quality.task_check import QUICK_TASK_ITEMS, TASK_ITEMS, run_task_check
from builder.quantize import calibration
from triton_backend.engine.config import TOKENIZER_DIR, EngineConfig
from triton_backend.models.text_request import chat_prompt_ids

QUALITY_FILE = "quality.json"
Progress = Callable[[str], None]
# The quick gate's share of the held-out windows and greedy prompts (the task items: task_check).
QUICK_WINDOWS, QUICK_PROMPTS = 2, 2


def _check(report: QualityReport, thresholds: QualityThresholds) -> list[str]:
    rules = (("perplexity_increase_pct", thresholds.max_perplexity_increase_pct, "<="),
             ("top1_agreement", thresholds.min_top1_agreement, ">="),
             ("logit_cosine", thresholds.min_logit_cosine, ">="),
             ("greedy_agreement", thresholds.min_greedy_agreement, ">="),
             ("task_retention", thresholds.min_task_retention, ">="))
    failures = []
    for metric, limit, op in rules:
        value = getattr(report, metric)
        if limit is None or value is None:
            continue
        ok = value <= limit if op == "<=" else value >= limit
        if not ok or math.isnan(value):
            failures.append(f"{metric} = {value:.4g} violates threshold {op} {limit:g}")
    if thresholds.must_keep:
        for item in report.task_changed_answers:
            if item["must_keep"] and item["change"] == "lost":
                failures.append(f"must_keep: {item['question']!r} is answered right by the "
                                f"reference, not by the engine ({short(item['engine_reply'])!r})")
    return failures


def evaluation_windows(tokenizer, thresholds: QualityThresholds, max_len: int) -> torch.Tensor:
    seq_len = min(thresholds.seq_len, max_len)
    texts = calibration.load_texts(thresholds.dataset)
    return calibration.token_windows(tokenizer, texts, thresholds.windows, seq_len,
                                     "evaluation", "quantization.quality.seq_len; forge check "
                                     "--threshold seq_len=N lowers it")


def compare(reference, engine, windows: torch.Tensor, thresholds: QualityThresholds,
            progress: Progress) -> dict:
    """The four metrics of `engine` against `reference` (both with .logits(ids) and .greedy)."""
    nll_ref = nll_eng = 0.0
    agree = cosine = count = 0.0
    eta = Eta("evaluation window", len(windows), progress)
    for window in windows.tolist():
        ref, eng = reference.logits(window), engine.logits(window)
        targets = torch.tensor(window[1:])
        nll_ref += F.cross_entropy(ref[:-1], targets, reduction="sum").item()
        nll_eng += F.cross_entropy(eng[:-1], targets, reduction="sum").item()
        agree += (ref.argmax(-1) == eng.argmax(-1)).sum().item()
        cosine += F.cosine_similarity(ref, eng, dim=-1).sum().item()
        count += len(window)
        eta.tick()
    predicted = count - len(windows)
    greedy = []
    prompts = windows.tolist()[:thresholds.prompts]
    eta = Eta("greedy prompt", len(prompts), progress)
    for window in prompts:
        prompt = window[:thresholds.prompt_len]
        ours = engine.greedy(prompt, thresholds.greedy_tokens)
        theirs = reference.greedy(prompt, thresholds.greedy_tokens)
        same = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        greedy.append(same / len(theirs))
        eta.tick()
    ppl_ref, ppl_eng = math.exp(nll_ref / predicted), math.exp(nll_eng / predicted)
    return {"reference_perplexity": ppl_ref, "engine_perplexity": ppl_eng,
            "perplexity_increase_pct": 100.0 * (ppl_eng / ppl_ref - 1.0),
            "top1_agreement": agree / count, "logit_cosine": cosine / count,
            "greedy_agreement": sum(greedy) / max(1, len(greedy)), "num_tokens": int(count)}


def evaluate(engine_dir: str | Path, reference_hf_dir: str | Path, thresholds: QualityThresholds,
             progress: Progress | None = None, reference=None) -> QualityReport:
    """Measure (never raise on a threshold): the report carries the failures. `reference` may be
    a `ReferenceModel` of `reference_hf_dir` to reuse across engines."""
    from transformers import AutoTokenizer

    from builder.quality.sides import EngineModel, ReferenceModel

    progress = progress or (lambda message: None)
    start = time.monotonic()
    config = EngineConfig.load(engine_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(engine_dir) / TOKENIZER_DIR))
    full = thresholds
    task_items = QUICK_TASK_ITEMS if thresholds.quick else TASK_ITEMS
    if thresholds.quick:
        thresholds = dataclasses.replace(thresholds, windows=min(thresholds.windows, QUICK_WINDOWS),
                                         prompts=min(thresholds.prompts, QUICK_PROMPTS))
    windows = evaluation_windows(tokenizer, thresholds, config.limits.max_input_len)
    longest_question = max((len(chat_prompt_ids(tokenizer, item.question)) for item in task_items),
                           default=0) if getattr(tokenizer, "chat_template", None) else 0
    engine = EngineModel(engine_dir, max(windows.shape[1] + thresholds.greedy_tokens,
                                         longest_question + thresholds.task_tokens))
    reference = reference or ReferenceModel(reference_hf_dir)
    progress(plan_line(reference_hf_dir, full.quick, len(windows),
                       min(thresholds.prompts, len(windows)),
                       len(task_items) if longest_question else 0))
    metrics = compare(reference, engine, windows, thresholds, progress)
    task = run_task_check(reference, engine, tokenizer, frozenset(config.tokenizer.eos_token_ids),
                          thresholds.task_tokens, thresholds.task_agreement_tokens, progress,
                          task_items)
    report = QualityReport(dataset=thresholds.dataset, reference=str(reference_hf_dir), **metrics,
                           **(task or {}))
    if full.quick:
        report.mode = "quick"
        report.scope = {"windows": f"{len(windows)} of {full.windows}",
                        "greedy_prompts": f"{min(thresholds.prompts, len(windows))} of "
                                          f"{full.prompts}"}
        if task:  # no chat template, no task check
            report.scope["task_items"] = f"{len(task_items)} of {len(TASK_ITEMS)}"
    record_gate_time(reference_hf_dir, full.quick, time.monotonic() - start)
    report.failures = _check(report, thresholds)
    return report


def run_quality_gate(engine_dir: str | Path, reference_hf_dir: str | Path,
                     thresholds: QualityThresholds, progress: Progress | None = None,
                     echo: Callable[[str], None] = print) -> QualityReport:
    """Evaluate, print the table, write `quality.json`; raise QualityGateError on a failure."""
    report = evaluate(engine_dir, reference_hf_dir, thresholds, progress)
    echo(format_table(report, thresholds))
    payload = {"passed": report.passed, "thresholds": dataclasses.asdict(thresholds),
               **dataclasses.asdict(report)}
    (Path(engine_dir) / QUALITY_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    if not report.passed:
        quick = f" ({QUICK_NOTE})" if report.mode == "quick" else ""
        raise QualityGateError("; ".join(report.failures) + quick)
    echo(verdict(report))  # first and last: the changed answers may push the table's top away
    return report

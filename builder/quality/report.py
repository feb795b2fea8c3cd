"""The quality gate's words: how long it took here last time (said before it starts), the
verdict first, the table, the changed answers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from builder.quality.metrics import QualityReport, QualityThresholds

QUICK_NOTE = "QUICK: a fraction of the gate, not the full one"
# How long each model's gates took on this machine, in the cache (keyed by the reference
# checkpoint's directory and the mode; entries of directories gone are dropped). A gate's time depends on the machine and on what else runs on
# it far more than on any count (the demo model's full gate: 68 s on a quiet 2-vCPU EPYC, 10 to
# 37 minutes while other builds shared its cores, phases stretched unevenly), so the estimate up
# front is the last measured time here, not one extrapolated from the work.
GATE_TIMES_FILE = "gate_times.json"
DEMO_GATE_NOTE = ("the demo model's full gate took 68 s on a quiet 2-vCPU EPYC, 10 to 37 "
                  "minutes while other builds shared it; its quick gate about a quarter of that")


def verdict(report: "QualityReport") -> str:
    """The report's first line (and the gate's last): passed, or failed and why."""
    quick = f" ({QUICK_NOTE})" if report.mode == "quick" else ""
    if report.passed:
        return f"quality gate: passed{quick}"
    return f"quality gate: FAILED{quick}: " + "; ".join(report.failures)


def _times_path() -> Path:
    from triton_backend.engine.cache_dir import cache_root

    return cache_root() / GATE_TIMES_FILE


def _gate_times() -> dict[str, float]:
    try:
        times = json.loads(_times_path().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: no estimate, never a failure
        return {}
    return times if isinstance(times, dict) else {}


def _key(reference: str | Path, quick: bool) -> str:
    return f"{Path(reference).resolve()}|{'quick' if quick else 'full'}"


def plan_line(reference: str | Path, quick: bool, windows: int, prompts: int,
              questions: int) -> str:
    """Said before the gate starts: its work and how long it took here last time."""
    from builder.pipeline.progress import format_duration

    times = _gate_times()
    mode = "quick" if quick else "full"
    line = (f"quality gate ({mode}): {windows} held-out windows, {prompts} greedy prompts, "
            f"{questions} questions, each through the reference and the engine; ")
    last, other = times.get(_key(reference, quick)), times.get(_key(reference, not quick))
    if last is None:
        return line + f"no earlier {mode} gate of this model here ({DEMO_GATE_NOTE})"
    line += f"the last {mode} one of this model here took {format_duration(last)}"
    if other is not None and not quick:
        line += f" (the quick one {format_duration(other)}: --quick-gate)"
    return line


def record_gate_time(reference: str | Path, quick: bool, seconds: float) -> None:
    """Keep this gate's time for the next one's estimate (best effort: a read-only cache, as in
    an image, keeps none)."""
    times = {key: value for key, value in _gate_times().items()
             if Path(key.rpartition("|")[0]).exists()}
    times[_key(reference, quick)] = round(seconds, 1)
    try:
        _times_path().parent.mkdir(parents=True, exist_ok=True)
        _times_path().write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass


def format_table(report: "QualityReport", thresholds: "QualityThresholds") -> str:
    """The verdict, then a plain-text table of the metrics, their thresholds and pass/fail,
    then every answer that changed."""
    rows = [("perplexity (reference)", f"{report.reference_perplexity:.3f}", "", ""),
            ("perplexity (engine)", f"{report.engine_perplexity:.3f}", "", "")]
    for metric, limit, op in (
            ("perplexity_increase_pct", thresholds.max_perplexity_increase_pct, "<="),
            ("top1_agreement", thresholds.min_top1_agreement, ">="),
            ("logit_cosine", thresholds.min_logit_cosine, ">="),
            ("greedy_agreement", thresholds.min_greedy_agreement, ">=")):
        failed = any(f.startswith(metric + " ") for f in report.failures)
        rows.append((metric, f"{getattr(report, metric):.4f}",
                     "" if limit is None else f"{op} {limit:g}",
                     "" if limit is None else ("FAIL" if failed else "ok")))
    if report.task_engine_score is not None:
        limit = thresholds.min_task_retention
        failed = any(f.startswith("task_retention ") for f in report.failures)
        retention = "n/a" if report.task_retention is None else f"{report.task_retention:.4f}"
        rows += [("task score (reference)", f"{report.task_reference_score:.4f}", "", ""),
                 ("task score (engine)", f"{report.task_engine_score:.4f}", "", ""),
                 ("task_retention", retention, "" if limit is None else f">= {limit:g}",
                  "" if limit is None or report.task_retention is None
                  else ("FAIL" if failed else "ok")),
                 ("task first tokens agree", f"{report.task_first_tokens_agreement:.4f}", "", "")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'value':>10}  {'threshold':>10}  result",
             f"{'-' * width}  {'-' * 10}  {'-' * 10}  ------"]
    lines += [f"{a:<{width}}  {b:>10}  {c:>10}  {d}" for a, b, c, d in rows]
    lines.append(f"({report.num_tokens} held-out tokens of {report.dataset!r})")
    if report.task_engine_score is not None:
        lines += changed_answers_lines(report)
    if report.mode == "quick":
        lines.insert(0, quick_banner(report))
    return "\n".join([verdict(report), *lines])


def quick_banner(report: "QualityReport") -> str:
    scope = ", ".join(f"{value} {name.replace('_', ' ')}" for name, value in report.scope.items())
    return (f"QUICK GATE ({scope}): not the full gate; `forge check --engine DIR` or a build "
            f"without --quick-gate runs it")


def changed_answers_lines(report: "QualityReport") -> list[str]:
    """The questions whose verdict changed vs the reference, lost ones first."""
    changed = sorted(report.task_changed_answers, key=lambda x: (x["change"] != "lost",
                                                                  not x["must_keep"]))
    lost = sum(x["change"] == "lost" for x in changed)
    asked = len(report.task_items)
    if not changed:
        return [f"answers changed vs the reference: none of {asked} questions"]
    lines = [f"answers changed vs the reference: {lost} lost, {len(changed) - lost} gained "
             f"(of {asked} questions)"]
    for item in changed:
        tag = item["change"] + (", must keep" if item["must_keep"] else "")
        # No square brackets: the build's console (rich) would read them as markup.
        lines += [f"  {tag}: {item['question']}",
                  f"      reference: {short(item['reference_reply'], 70)}",
                  f"      engine:    {short(item['engine_reply'], 70)}"]
    return lines


def short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."

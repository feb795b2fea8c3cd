"""The quality gate's words: the verdict first, the table, the changed answers, and how long
the gate will take, said once a window is timed."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from builder.quality import QualityReport, QualityThresholds

QUICK_NOTE = "QUICK: a fraction of the gate, not the full one"
# A greedy prompt and a task question in evaluation windows (a window: one prefill of `seq_len`
# tokens by the reference and by the engine), per token they generate: measured on the demo
# model with the default thresholds (8 windows 53 s, 8 prompts of 16 tokens 124 s, 46 questions
# of up to 24 tokens 444 s; a 2-vCPU AMD EPYC shared with other work). Decoding costs the same
# relative to a prefill on any CPU to within the estimate's "about".
WINDOWS_PER_GREEDY_TOKEN = 2.35 / 16
WINDOWS_PER_TASK_TOKEN = 1.45 / 24


def verdict(report: "QualityReport") -> str:
    """The report's first line (and the gate's last): passed, or failed and why."""
    quick = f" ({QUICK_NOTE})" if report.mode == "quick" else ""
    if report.passed:
        return f"quality gate: passed{quick}"
    return f"quality gate: FAILED{quick}: " + "; ".join(report.failures)


def gate_seconds(window_seconds: float, windows: int, prompts: int, greedy_tokens: int,
                 questions: int, task_tokens: int) -> float:
    """The whole gate's time from one window's (see WINDOWS_PER_*)."""
    units = (windows + prompts * greedy_tokens * WINDOWS_PER_GREEDY_TOKEN
             + questions * task_tokens * WINDOWS_PER_TASK_TOKEN)
    return window_seconds * units


def estimate_line(window_seconds: float, thresholds: "QualityThresholds", windows: int,
                  prompts: int, questions: int, quick: tuple[int, int, int] | None) -> str:
    """Said once a window is timed: the gate's work and its time on this machine now;
    `quick`: the quick gate's (windows, prompts, questions), offered when this one is full."""
    from builder.progress import format_duration

    def total(w: int, p: int, q: int) -> str:
        return format_duration(gate_seconds(window_seconds, w, p, thresholds.greedy_tokens, q,
                                            thresholds.task_tokens))

    line = (f"quality gate: {windows} held-out windows, {prompts} greedy prompts, {questions} "
            f"questions, each through the reference and the engine: about "
            f"{total(windows, prompts, questions)} on this machine now")
    if quick is not None:
        line += f" (--quick-gate: about {total(*quick)})"
    return line


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

"""The gate's task check: item scoring, retention against the reference, and its thresholds."""
import pytest

import json

from builder.errors import QualityGateError
from builder.quality.gate import _check, format_table
from builder.quality.metrics import QualityReport, QualityThresholds
from builder.quality.task_check import (DEMO_QUESTION, QUICK_TASK_ITEMS, TASK_ITEMS, TaskItem, answered,
                                run_task_check)


def test_the_built_in_set_has_over_forty_items_each_with_an_answer():
    assert len(TASK_ITEMS) >= 40
    assert len({item.question for item in TASK_ITEMS}) == len(TASK_ITEMS)
    assert all(item.answers and all(item.answers) for item in TASK_ITEMS)


@pytest.mark.parametrize("reply, item, expected", [
    ("The capital of France is Paris.", TaskItem("q", ("Paris",)), True),
    ("paris, of course", TaskItem("q", ("Paris",)), True),
    ("Comparison is hard", TaskItem("q", ("Paris",)), False),   # a whole word, not a substring
    ("2 + 3 = 5.", TaskItem("q", ("5", "five")), True),
    ("It is 15.", TaskItem("q", ("5", "five")), False),         # 15 is not 5
    ("Five.", TaskItem("q", ("5", "five")), True),
    ("cat", TaskItem("q", ("CAT",), exact_case=True), False),
    ("CAT", TaskItem("q", ("CAT",), exact_case=True), True),
])
def test_an_answer_counts_as_a_whole_word(reply, item, expected):
    assert answered(reply, item) is expected


class _Tokenizer:
    """Each question is one id (its index); a reply id r decodes to the text of answer r."""
    chat_template = "yes"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [next(i for i, it in enumerate(TASK_ITEMS) if it.question == messages[0]["content"])]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join("nonsense" if i < 0 else TASK_ITEMS[i].answers[0] for i in ids)


class _Model:
    def __init__(self, right: set[int]) -> None:
        self.right = right

    def greedy(self, prompt, num_tokens):
        index = prompt[0]
        return ([index] if index in self.right else [-1]) + [999] * (num_tokens - 1)


def test_retention_is_measured_on_what_the_reference_gets_right():
    everything = set(range(len(TASK_ITEMS)))
    reference, engine = _Model(set(range(20))), _Model(set(range(10, 30)))
    task = run_task_check(reference, engine, _Tokenizer(), frozenset({999}), 4, 1, lambda m: None)
    assert task["task_reference_score"] == pytest.approx(20 / len(TASK_ITEMS))
    assert task["task_engine_score"] == pytest.approx(20 / len(TASK_ITEMS))
    assert task["task_retention"] == pytest.approx(10 / 20)  # items 10..19 of the reference's 20
    first = task["task_items"][0]
    assert first["reference_correct"] and not first["engine_correct"]
    assert first["engine_reply"] == "nonsense" and first["reference_reply"] == TASK_ITEMS[0].answers[0]
    none = run_task_check(_Model(set()), _Model(everything), _Tokenizer(), frozenset({999}), 4, 1,
                          lambda m: None)
    assert none["task_retention"] is None  # nothing to retain: reported, not gated


def _report(retention):
    return QualityReport(1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 10, "d", "r", task_retention=retention,
                         task_engine_score=0.5, task_reference_score=0.6)


def test_the_gate_fails_below_the_retention_threshold_and_skips_when_there_is_none():
    thresholds = QualityThresholds(min_task_retention=0.9)
    assert _check(_report(0.95), thresholds) == []
    assert _check(_report(0.5), thresholds) == ["task_retention = 0.5 violates threshold >= 0.9"]
    assert _check(_report(None), thresholds) == []
    assert _check(_report(0.5), QualityThresholds(min_task_retention=None)) == []
    with pytest.raises(ValueError, match="quantization.quality.task_tokens: an integer >= 1, got 0"):
        QualityThresholds(task_tokens=0)


def _task(reference_right: set[int], engine_right: set[int], items=TASK_ITEMS) -> dict:
    return run_task_check(_Model(reference_right), _Model(engine_right), _Tokenizer(),
                          frozenset({999}), 4, 1, lambda m: None, items)


def _gated(task: dict, retention: float | None = None) -> QualityReport:
    report = QualityReport(1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 10, "d", "r", **task)
    if retention is not None:
        report.task_retention = retention
    return report


def test_the_demo_question_is_the_first_item_and_must_be_kept():
    assert TASK_ITEMS[0] is DEMO_QUESTION and DEMO_QUESTION.must_keep
    assert DEMO_QUESTION.question == "What is the capital of France?"
    assert [item for item in TASK_ITEMS if item.must_keep] == [DEMO_QUESTION]


def test_every_changed_answer_is_listed_as_lost_or_gained():
    task = _task(set(range(20)), set(range(10, 30)))
    changed = {x["question"]: x for x in task["task_changed_answers"]}
    assert set(changed) == {TASK_ITEMS[i].question for i in [*range(10), *range(20, 30)]}
    assert all(changed[TASK_ITEMS[i].question]["change"] == "lost" for i in range(10))
    assert all(changed[TASK_ITEMS[i].question]["change"] == "gained" for i in range(20, 30))
    france = changed[DEMO_QUESTION.question]
    assert france["must_keep"] and france["engine_reply"] == "nonsense"
    assert france["reference_reply"] == "Paris"
    assert _task(set(range(5)), set(range(5)))["task_changed_answers"] == []


def test_the_report_prints_the_changed_answers_lost_ones_first():
    task = _task({0, 1, 2}, {1, 2, 3})
    table = format_table(_gated(task), QualityThresholds())
    lines = table.splitlines()
    start = lines.index("answers changed vs the reference: 1 lost, 1 gained (of 46 questions)")
    assert lines[start + 1] == "  lost, must keep: What is the capital of France?"
    assert lines[start + 2].split() == ["reference:", "Paris"]
    assert lines[start + 3].split() == ["engine:", "nonsense"]
    assert lines[start + 4] == f"  gained: {TASK_ITEMS[3].question}"
    unchanged = format_table(_gated(_task({0, 1}, {0, 1})), QualityThresholds())
    assert "answers changed vs the reference: none of 46 questions" in unchanged


def test_losing_a_must_keep_item_fails_the_gate_whatever_the_retention():
    everything_but_france = set(range(1, len(TASK_ITEMS)))
    task = _task(set(range(len(TASK_ITEMS))), everything_but_france)
    report = _gated(task)
    assert report.task_retention == pytest.approx(45 / 46)  # well above 0.9
    assert _check(report, QualityThresholds()) == [
        "must_keep: 'What is the capital of France?' is answered right by the reference, not "
        "by the engine ('nonsense')"]
    assert _check(report, QualityThresholds(must_keep=False)) == []  # reported only
    # Gaining it, or both sides missing it, is no failure.
    assert _check(_gated(_task(everything_but_france, set(range(46)))), QualityThresholds()) == []
    assert _check(_gated(_task(set(), set())), QualityThresholds()) == []
    with pytest.raises(ValueError, match="quantization.quality.must_keep: true or false"):
        QualityThresholds(must_keep="yes")


def test_the_quick_set_is_a_spread_of_the_items_with_every_must_keep_one():
    assert DEMO_QUESTION in QUICK_TASK_ITEMS
    assert 8 <= len(QUICK_TASK_ITEMS) <= len(TASK_ITEMS) // 3
    kinds = {TASK_ITEMS.index(item) // 10 for item in QUICK_TASK_ITEMS}
    assert kinds == {0, 1, 2, 3, 4}  # from the start of the set to its end
    task = _task(set(range(len(TASK_ITEMS))), set(), QUICK_TASK_ITEMS)
    assert [x["question"] for x in task["task_items"]] == [i.question for i in QUICK_TASK_ITEMS]


def test_a_quick_gate_says_so_in_its_table_verdict_and_report(tmp_path, monkeypatch):
    import builder.quality.gate as quality

    report = _gated(_task({1, 2}, {1, 2}, QUICK_TASK_ITEMS))
    report.mode, report.scope = "quick", {"windows": "2 of 8", "greedy_prompts": "2 of 8",
                                          "task_items": f"{len(QUICK_TASK_ITEMS)} of 46"}
    monkeypatch.setattr(quality, "evaluate", lambda *args, **kwargs: report)
    said: list[str] = []
    quality.run_quality_gate(tmp_path, tmp_path, QualityThresholds(quick=True), echo=said.append)
    table = said[0].splitlines()
    assert table[0] == "quality gate: passed (QUICK: a fraction of the gate, not the full one)"
    assert table[1].startswith("QUICK GATE (2 of 8 windows, 2 of 8 greedy prompts, "
                               f"{len(QUICK_TASK_ITEMS)} of 46 task items): not the full gate")
    assert said[-1] == "quality gate: passed (QUICK: a fraction of the gate, not the full one)"
    written = json.loads((tmp_path / "quality.json").read_text())
    assert written["mode"] == "quick" and written["thresholds"]["quick"] is True
    report.failures = ["task_retention = 0.5 violates threshold >= 0.9"]
    with pytest.raises(QualityGateError, match=r"0\.9 \(QUICK: a fraction of the gate"):
        quality.run_quality_gate(tmp_path, tmp_path, QualityThresholds(quick=True),
                                 echo=said.append)


def test_quick_gate_flag_sets_the_spec_key_and_is_refused_where_no_gate_runs():
    from builder.cli.engine import quick_gate_spec
    from builder.spec.build_spec import SpecError

    data = {"quantization": {"weights": "int4_rtn", "quality": {"min_task_retention": 0.8}}}
    quick_gate_spec(data)
    assert data["quantization"]["quality"] == {"min_task_retention": 0.8, "quick": True}
    with pytest.raises(SpecError, match="--quick-gate: this build has no quality gate"):
        quick_gate_spec({"quantization": {"weights": "none"}})

"""The gate's task check: item scoring, retention against the reference, and its thresholds."""
import pytest

from builder.quality import QualityReport, QualityThresholds, _check
from builder.task_check import TASK_ITEMS, TaskItem, answered, run_task_check


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

"""The step-cost line (fixed and per-row cost of a step) and the limits that size the room for
prefill rows beside decodes; the scheduler's use of them is in test_scheduler.py."""
import pytest

from triton_backend.engine.config import Limits
from triton_backend.engine.step_cost import StepCostModel


def test_fit_recovers_fixed_and_per_row_cost_from_two_row_counts():
    model = StepCostModel()
    for _ in range(10):
        model.observe(8, 0.010 + 8 * 0.001)
        model.observe(12, 0.010 + 12 * 0.001)
    fixed, per_row = model.fit()
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.001)
    # 8 decode rows take 18 ms; at 1.5x (27 ms) the step may carry 9 more rows
    assert model.extra_rows(8, 1.5) == 9


def test_one_row_count_or_too_few_steps_read_as_all_per_row_cost():
    model = StepCostModel(min_steps=8)
    assert model.fit() is None and model.extra_rows(8, 1.5) == 4  # nothing measured yet
    for _ in range(8):
        model.observe(8, 0.016)
    assert model.fit() == (0.0, pytest.approx(0.002))
    assert model.extra_rows(8, 1.5) == 4
    assert model.extra_rows(1, 1.2) == 1  # a prefill always moves on


def test_a_falling_line_is_not_believed():
    model = StepCostModel(decay=1.0, min_steps=2)
    model.observe(4, 0.020)
    model.observe(8, 0.010)  # noise: more rows, less time
    assert model.fit() == (0.0, pytest.approx(0.030 / 12))


def test_long_prefill_tokens_is_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"limits.long_prefill_tokens must be an integer in "
                                         r"\[0, limits.max_num_tokens \(64\)\] or absent, got 65"):
        Limits(max_num_tokens=64, long_prefill_tokens=65)
    assert Limits(max_num_tokens=64, long_prefill_tokens=0).long_prefill_tokens == 0


@pytest.mark.parametrize("value", [1.0, 0.5, -1, True, "fast", 101])
def test_max_decode_slowdown_is_validated_naming_the_field(value):
    with pytest.raises(ValueError, match="limits.max_decode_slowdown must be 0 .off. or a "
                                         "number in .1, 100."):
        Limits(max_decode_slowdown=value)

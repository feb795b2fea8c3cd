"""The step-cost model (fixed, per-row and per-key cost of a step) and the limits that size the
room for prefill rows beside decodes; the scheduler's use of them is in test_scheduler.py."""
import pytest

from triton_backend.engine.config import Limits
from triton_backend.engine.step_cost import PRIOR_FIXED_ROWS, StepCostModel, keys_of


def test_fit_recovers_fixed_and_per_row_cost_from_two_row_counts():
    model = StepCostModel()
    for _ in range(10):
        model.observe(8, 0.010 + 8 * 0.001)
        model.observe(12, 0.010 + 12 * 0.001)
    fixed, per_row, per_key = model.fit()
    assert per_key == 0  # no keys reported: a line
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.001)
    # 8 decode rows take 18 ms: a 27 ms target leaves 9 more rows, 3 decode steps (54 ms) 36
    assert model.predict(8) == pytest.approx(0.018)
    assert model.extra_rows(8, 0.027, 3.0) == 9
    assert model.extra_rows(8, None, 3.0) == 36
    assert model.extra_rows(8, 0.010, 3.0) == 1  # a target under the decode step: 1 row still


def test_before_a_line_the_prior_split_reads_the_steps():
    model = StepCostModel(min_steps=8)
    # nothing measured: (steps - 1) x (PRIOR_FIXED_ROWS + rows), whatever the target in ms
    assert model.fit() is None and model.predict(8) is None
    assert PRIOR_FIXED_ROWS == 8
    assert model.extra_rows(8, None, 1.5) == 8 and model.extra_rows(8, 0.5, 3.0) == 32
    for _ in range(8):
        model.observe(8, 0.016)  # one row count: the split is unknown, the prior reads it
    assert model.fit() == (pytest.approx(0.008), pytest.approx(0.001), 0)
    assert model.extra_rows(8, None, 3.0) == 32
    assert model.extra_rows(8, 0.0215, 3.0) == 5
    assert model.extra_rows(1, 0.001, 1.2) == 1  # a prefill always moves on


def test_a_good_line_stands_while_the_steps_all_have_one_size():
    """A batch that settles into one step size teaches nothing new: the line it learnt stands
    (reading the split as unknown again shrank the chunks and kept the steps one size)."""
    model = StepCostModel(decay=0.5, min_steps=2)
    for rows in (4, 40, 4, 40):
        model.observe(rows, 0.020 + rows * 0.002)
    assert model.fit() == (pytest.approx(0.020), pytest.approx(0.002), 0)
    for _ in range(40):
        model.observe(12, 0.050)  # one size, slower: no new line
    assert model.fit() == (pytest.approx(0.020), pytest.approx(0.002), 0)


def test_a_falling_line_is_not_believed():
    model = StepCostModel(decay=1.0, min_steps=2)
    model.observe(4, 0.020)
    model.observe(8, 0.010)  # noise: more rows, less time: the prior split of the mean step
    assert model.fit() == (pytest.approx(8 * 0.015 / 14), pytest.approx(0.015 / 14), 0)


def test_keys_count_what_a_causal_chunk_attends():
    assert keys_of(0, 1) == 1 and keys_of(9, 1) == 10  # a decode row at position 9
    assert keys_of(0, 4) == 1 + 2 + 3 + 4 and keys_of(100, 4) == 4 * 100 + 10


def test_the_plane_separates_attention_from_rows_and_sizes_chunks_deep_in_a_prompt():
    """Chunks of one size cost more deep in a long prompt: the fit finds the per-key cost, and
    the room for a chunk from position 1,536 is smaller than from position 0."""
    model = StepCostModel()
    fixed, per_row, per_key = 0.020, 0.002, 1e-6
    for start in (0, 512, 1024, 1536) * 4:  # 4 decodes at 2,000 keys each, a 96-row chunk
        for rows, keys in ((4, 4 * 2000), (4 + 96, 4 * 2000 + keys_of(start, 96))):
            model.observe(rows, fixed + per_row * rows + per_key * keys, keys)
    fit = model.fit()
    assert fit == (pytest.approx(fixed), pytest.approx(per_row), pytest.approx(per_key))
    assert model.predict(4, 8000) == pytest.approx(0.036)
    # 250 ms - the 36 ms decode step = 214 ms: from 0, r rows cost 2 ms + 1 us x (r + 1) / 2
    # each (r = 104); from 1,536 each row also reads 1,536 keys (r = 60)
    assert model.extra_rows(4, 0.250, 3.0, keys=8000, start=0) == 104
    assert model.extra_rows(4, 0.250, 3.0, keys=8000, start=1536) == 60
    for r in (104, 60):  # the largest chunk that fits
        start = 0 if r == 104 else 1536
        assert model.predict(4 + r, 8000 + keys_of(start, r)) <= 0.250
        assert model.predict(5 + r, 8000 + keys_of(start, r + 1)) > 0.250


def test_keys_that_only_move_with_the_rows_leave_a_line():
    """Steps whose keys are a fixed multiple of their rows cannot tell the two costs apart: the
    fit is the line over rows (per_key 0), not a plane from noise."""
    model = StepCostModel(decay=1.0, min_steps=2)
    for rows in (4, 40, 4, 40):
        model.observe(rows, 0.020 + rows * 0.002, keys=rows * 500)
    assert model.fit() == (pytest.approx(0.020), pytest.approx(0.002), 0)


@pytest.mark.parametrize("value", [-1, True, "fast", 60_001, None])
def test_target_itl_ms_is_validated_naming_the_field(value):
    with pytest.raises(ValueError, match=r'limits.target_itl_ms must be "auto", 0 \(no target\) '
                                         r"or a number of ms in \(0, 60000\], got "):
        Limits(target_itl_ms=value)
    assert Limits(target_itl_ms=80).target_itl_ms == 80 and Limits().target_itl_ms == "auto"


def test_an_older_engines_scheduler_ratio_is_dropped_for_the_auto_target():
    from triton_backend.engine.config import RETIRED_LIMITS, EngineConfig, ModelShape

    limits = dict(max_batch_size=4, max_num_tokens=64, max_input_len=32, max_seq_len=64)
    config = EngineConfig(name="x", target="torch", dtype="float32",
                          model=ModelShape("llama", 128, 64, 128, 2, 4, 2, 16),
                          limits=Limits(**limits))
    data = config.to_dict()
    data["limits"] = dict(data["limits"], max_decode_slowdown=1.5, long_prefill_tokens=8)
    data["limits"].pop("target_itl_ms")
    assert EngineConfig.from_dict(data).limits == Limits(**limits)
    assert set(RETIRED_LIMITS) == {"max_decode_slowdown", "long_prefill_tokens"}

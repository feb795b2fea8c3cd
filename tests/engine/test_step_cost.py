"""Prefill chunks beside decodes: the step-cost line and the scheduler's room for prefill rows."""
import pytest

from scheduling import run, seq
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.config import Limits
from triton_backend.engine.scheduler import Scheduler
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


def test_prefill_beside_decodes_is_cut_to_the_room_and_finishes():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, max_decode_slowdown=1.5,
                      long_prefill_tokens=0)  # every prefill counts as long
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    assert run(sched, 2)[1] == [(i, 1) for i in range(4)]  # prefilled, now decoding
    sched.add(seq(9, 30, max_tokens=2))
    log = run(sched, 16)
    # nothing measured: all cost is per row, so 4 decode rows leave room for 2 prefill rows
    assert log[0] == [(0, 1), (1, 1), (2, 1), (3, 1), (9, 2)]
    prefill = [n for step in log for s, n in step if s == 9]
    assert prefill[:15] == [2] * 15 and sum(prefill) == 30 + 1  # 30 prompt tokens, 1 decode


def test_a_long_prompt_is_cut_until_its_rest_is_short_then_goes_whole():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, max_decode_slowdown=1.5)
    assert sched.long_prefill_threshold == 8  # max_num_tokens // 8 when not given
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 2)
    sched.add(seq(9, 30, max_tokens=2))
    prefill = [n for step in run(sched, 16) for s, n in step if s == 9]
    # 2 rows a step beside 4 decodes while more than 8 tokens are left, then the 8 at once
    assert prefill[:12] == [2] * 11 + [8] and sum(prefill[:12]) == 30


def test_short_prompts_are_prefilled_whole_beside_decodes_even_past_the_room():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, max_decode_slowdown=1.5,
                      long_prefill_tokens=12)
    sched.add(seq(0, 3, max_tokens=40))
    run(sched, 1)  # one sequence decodes: the room beside it is 1 row
    for i in (1, 2, 3):
        sched.add(seq(i, 12, max_tokens=4))
    sched.add(seq(4, 13, max_tokens=4))  # long: waits for room, and keeps its place in line
    sched.add(seq(5, 4, max_tokens=4))
    assert run(sched, 1)[0] == [(0, 1), (1, 12), (2, 12), (3, 12)]


def test_long_prefill_tokens_is_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"limits.long_prefill_tokens must be an integer in "
                                         r"\[0, limits.max_num_tokens \(64\)\] or absent, got 65"):
        Limits(max_num_tokens=64, long_prefill_tokens=65)
    assert Limits(max_num_tokens=64, long_prefill_tokens=0).long_prefill_tokens == 0


def test_measured_fixed_cost_widens_the_room():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, max_decode_slowdown=2.0)
    for _ in range(10):  # a memory-bound step: 40 ms whatever the rows, plus 1 ms per row
        sched.step_cost.observe(4, 0.044)
        sched.step_cost.observe(8, 0.048)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 1)
    sched.add(seq(9, 60, max_tokens=2))
    assert run(sched, 1)[0][-1] == (9, 44)  # 2x of 44 ms leaves 44 rows


def test_no_cap_without_decodes_or_when_off():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=16, max_batch_size=8, max_decode_slowdown=1.5)
    sched.add(seq(1, 40, max_tokens=2))
    assert run(sched, 1) == [[(1, 16)]]  # nothing decodes: the whole budget
    off = Scheduler(BlockManager(num_blocks=64, tokens_per_block=4), max_num_tokens=16,
                    max_batch_size=8, max_decode_slowdown=0)
    off.add(seq(1, 3, max_tokens=40))
    run(off, 1)
    off.add(seq(2, 40, max_tokens=2))
    assert run(off, 1) == [[(1, 1), (2, 15)]]


@pytest.mark.parametrize("value", [1.0, 0.5, -1, True, "fast", 101])
def test_max_decode_slowdown_is_validated_naming_the_field(value):
    with pytest.raises(ValueError, match="limits.max_decode_slowdown must be 0 .off. or a "
                                         "number in .1, 100."):
        Limits(max_decode_slowdown=value)


def test_with_only_short_prompts_the_default_schedules_as_the_throttle_off():
    """The vLLM workload's shape: waves of 128-token prompts arriving one by one among decodes.
    Every prompt is short (<= max_num_tokens / 8), so the default's schedule is the one with the
    throttle off, step for step (whatever the step-cost line has learned)."""
    def schedules(slowdown: float) -> list:
        sched = Scheduler(BlockManager(num_blocks=2048, tokens_per_block=16), max_num_tokens=2048,
                          max_batch_size=32, max_decode_slowdown=slowdown)
        for _ in range(20):
            sched.step_cost.observe(16, 0.040)  # a compute-bound CPU: all cost per row
        log, next_id = [], 0
        for step in range(400):
            if step % 9 == 0 and next_id < 48:  # arrivals trickle in between steps
                for _ in range(min(1 + step % 4, 48 - next_id)):
                    sched.add(seq(next_id, 128, max_tokens=64))
                    next_id += 1
            log += run(sched, 1)
        assert next_id == 48 and not sched.has_work()
        return log

    assert schedules(1.5) == schedules(0)

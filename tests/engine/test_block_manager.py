"""Block manager and scheduler on tiny pools, with exact block ids (no torch, no model)."""
import pytest

from scheduling import run, seq
from triton_backend.engine import FinishReason
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.scheduler import Scheduler


def test_allocation_on_demand_and_exact_ids():
    bm = BlockManager(num_blocks=4, tokens_per_block=4)
    a, b = seq(1, 5), seq(2, 3)
    assert bm.can_allocate(a, 5) and bm.num_blocks_needed(a, 5) == 2
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    assert a.block_table == [0, 1] and b.block_table == [2]
    a.num_computed_tokens = 5
    assert bm.num_blocks_needed(a, 3) == 0  # 8 tokens still fit in two blocks
    assert bm.num_blocks_needed(a, 4) == 1
    assert bm.slot(a, 5) == 1 * 4 + 1
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3
    assert list(bm.free_block_ids) == [3, 1, 0]
    c = seq(3, 9)
    assert not bm.can_allocate(c, 13)
    with pytest.raises(RuntimeError):
        bm.allocate(c, 13)
    bm.allocate(c, 9)
    assert c.block_table == [3, 1, 0]


def test_scheduler_budget_chunks_prefill_and_admits_in_flight():
    bm = BlockManager(num_blocks=16, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=6, max_batch_size=4)
    sched.add(seq(1, 10, max_tokens=3))
    log = run(sched, 2)
    assert log == [[(1, 6)], [(1, 4)]]  # 10-token prompt in two chunks of the 6-token budget
    sched.add(seq(2, 2, max_tokens=2))
    log = run(sched, 3)
    # seq 1 decodes while seq 2 joins mid-flight; seq 2 finishes after 2 tokens, seq 1 after 3
    assert log == [[(1, 1), (2, 2)], [(1, 1), (2, 1)], []]
    assert bm.num_free_blocks == 16 and not sched.has_work()


def test_scheduler_preempts_youngest_and_recomputes_it():
    bm = BlockManager(num_blocks=3, tokens_per_block=2)
    sched = Scheduler(bm, max_num_tokens=16, max_batch_size=4)
    old, young = seq(1, 2, max_tokens=3), seq(2, 2, max_tokens=3)
    sched.add(old)
    sched.add(young)
    log = run(sched, 1)
    assert log == [[(1, 2), (2, 2)]] and old.block_table == [0] and young.block_table == [1]
    # both need a second block for their third token; one block is free: the older gets it and
    # the youngest is preempted (its block goes back to the pool)
    log = run(sched, 1)
    assert log == [[(1, 1)]] and old.block_table == [0, 2]
    assert sched.num_preemptions == 1 and young.num_computed_tokens == 0 and young.block_table == []
    log = run(sched, 1)  # young needs 2 blocks to recompute, 1 is free: it waits
    assert log == [[(1, 1)]] and old.is_finished and bm.num_free_blocks == 3
    log = run(sched, 2)  # young recomputes prompt + its generated token in one chunk
    assert log == [[(2, 3)], [(2, 1)]] and young.is_finished
    assert young.generated_token_ids == [7, 7, 7] and bm.num_free_blocks == 3


def test_max_batch_size_limits_running_sequences():
    bm = BlockManager(num_blocks=32, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=100, max_batch_size=2)
    for i in range(1, 5):
        sched.add(seq(i, 3, max_tokens=2))
    log = run(sched, 1)
    assert [s for s, _ in log[0]] == [1, 2]
    assert len(sched.waiting) == 2


def test_abort_frees_blocks_wherever_the_sequence_is():
    bm = BlockManager(num_blocks=8, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=100, max_batch_size=8)
    running, waiting = seq(1, 6), seq(2, 3)
    sched.add(running)
    run(sched, 1)
    sched.add(waiting)
    sched.abort(running, FinishReason.CANCELLED)
    sched.abort(waiting, FinishReason.CANCELLED)
    assert bm.num_free_blocks == 8 and not sched.has_work()
    assert running.finish_reason == FinishReason.CANCELLED and running.is_finished

"""Priorities in the scheduler: admission order, preemption order and aging, on tiny pools with an
injected clock (no torch, no model, no sleeps)."""
import pytest

from scheduling import Clock, seq, step
from triton_backend.engine import FinishReason, Request
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.scheduler import Scheduler
from triton_backend.engine.sequence import Sequence
from triton_backend.engine.waiting_queue import WaitingQueue

SECOND = 1_000_000_000


def scheduler(num_blocks: int = 16, tokens_per_block: int = 4, max_num_tokens: int = 64,
              max_batch_size: int = 1, **options) -> tuple[Scheduler, Clock]:
    """A scheduler over a fresh block pool, on an injected clock at 0."""
    clock = Clock()
    return Scheduler(BlockManager(num_blocks, tokens_per_block), max_num_tokens=max_num_tokens,
                     max_batch_size=max_batch_size, clock=clock, **options), clock


def admitted_order(sched: Scheduler, steps: int) -> list[int]:
    order = []
    for _ in range(steps):
        for chunk in step(sched).chunks:
            if chunk.num_computed_tokens == 0 and chunk.seq_id not in order:
                order.append(chunk.seq_id)
    return order


def test_higher_priority_is_admitted_first_and_equal_priorities_in_arrival_order():
    sched, clock = scheduler()
    for seq_id, priority in [(1, 0), (2, 5), (3, -3), (4, 5), (5, 0)]:
        sched.add(seq(seq_id, max_tokens=1, priority=priority))
        clock.now += 1_000_000  # 1 ms apart: far less than aging could make up
    assert [s.seq_id for s in sched.waiting] == [2, 4, 1, 5, 3]
    assert admitted_order(sched, 5) == [2, 4, 1, 5, 3]
    assert not sched.has_work()


def test_the_least_urgent_running_sequence_is_preempted_first():
    sched, clock = scheduler(num_blocks=3, tokens_per_block=2, max_num_tokens=16,
                             max_batch_size=4)
    bm = sched.block_manager
    low = seq(1, max_tokens=3, priority=-10)  # older, but low priority
    clock.now = SECOND // 10
    high = seq(2, max_tokens=3, priority=10)
    sched.add(low)
    sched.add(high)
    out = step(sched)
    assert [c.seq_id for c in out.chunks] == [2, 1]  # most urgent first
    assert high.block_table == [0] and low.block_table == [1]
    # both need a second block for their third token and one is free: high keeps running, low
    # (not the youngest) yields its block
    out = step(sched)
    assert out.preempted_seq_ids == [1] and [c.seq_id for c in out.chunks] == [2]
    assert high.block_table == [0, 2] and low.block_table == [] and low.num_computed_tokens == 0
    step(sched)
    assert high.is_finished
    # low is recomputed later, from its tokens, and finishes: nothing accepted is dropped
    for _ in range(3):
        step(sched)
    assert low.is_finished and low.generated_token_ids == [7, 7, 7]
    assert bm.num_free_blocks == 3 and sched.num_preemptions == 1


def test_a_preempted_sequence_goes_back_by_its_urgency():
    sched, clock = scheduler(num_blocks=3, tokens_per_block=2, max_num_tokens=16,
                             max_batch_size=2)
    a, b = seq(1, max_tokens=3), seq(2, max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)
    clock.now = SECOND
    late = seq(3, max_tokens=1)  # same priority, arrives after b
    sched.add(late)
    out = step(sched)  # b is preempted; it arrived before `late`, so it waits ahead of it
    assert out.preempted_seq_ids == [2]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


def test_aging_admits_a_low_priority_request_however_many_high_ones_arrive():
    # aging rate 1 level/s: a priority-0 request that arrived at t=0 counts the same as a
    # priority-5 one arriving at t=5s; one high-priority request arrives every second and each
    # step admits (and finishes) one request.
    sched, clock = scheduler(num_blocks=64, priority_aging_rate=1.0)
    sched.add(seq(100, max_tokens=1, priority=0))
    order = []
    for k in range(1, 8):
        clock.now = k * SECOND
        sched.add(seq(k, max_tokens=1, priority=5))
        order += admitted_order(sched, 1)
    # h1..h4 (virtual arrival -4..-1 s) go first, then the low one ties with h5 (0 s) and wins
    # on its earlier real arrival, then the rest
    assert order == [1, 2, 3, 4, 100, 5, 6]


def test_a_faster_aging_rate_admits_the_low_priority_request_sooner():
    sched, clock = scheduler(num_blocks=64, priority_aging_rate=10.0)
    sched.add(seq(100, max_tokens=1, priority=0))
    order = []
    for k in range(1, 4):
        clock.now = k * SECOND // 10  # one every 100 ms; +5 levels = a 500 ms head start
        sched.add(seq(k, max_tokens=1, priority=5))
        order += admitted_order(sched, 1)
    assert order == [1, 2, 3]
    clock.now = 6 * SECOND // 10  # virtual arrival 0.1 s: after the low one's 0 s
    sched.add(seq(4, max_tokens=1, priority=5))
    assert admitted_order(sched, 2) == [100, 4]


def test_waiting_load_counts_requests_and_tokens_including_preempted_ones():
    sched, clock = scheduler(num_blocks=3, tokens_per_block=2, max_num_tokens=16,
                             max_batch_size=2)
    a, b = seq(1, max_tokens=3), seq(2, max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert sched.waiting.load() == (2, 4)
    step(sched)
    assert sched.waiting.load() == (0, 0)
    step(sched)  # b is preempted with its 3 tokens (2 prompt + 1 generated) to prefill again
    assert sched.waiting.load() == (1, 3)
    sched.abort(b, FinishReason.CANCELLED)
    assert sched.waiting.load() == (0, 0) and b not in sched.waiting


def test_arrival_comes_from_the_request_when_it_has_one():
    sched, clock = scheduler()
    clock.now = 50 * SECOND
    early = Sequence.from_request(1, Request([1, 2], 1, arrival_time_ns=10 * SECOND), frozenset())
    now = seq(2, max_tokens=1, priority=30)  # stamped at 50 s: virtual arrival 20 s, after `early`'s 10 s
    sched.add(now)
    sched.add(early)
    assert early.arrival_ns == 10 * SECOND and now.arrival_ns == 50 * SECOND
    assert admitted_order(sched, 2) == [1, 2]
    assert early.scheduled_ns == 50 * SECOND


def test_aging_rate_must_be_positive():
    with pytest.raises(ValueError, match=r"priority_aging_rate must be > 0, got 0"):
        WaitingQueue(0)

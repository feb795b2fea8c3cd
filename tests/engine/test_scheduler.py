"""The scheduler on tiny pools with a fake model runner (no torch, no model, no sleeps): the token
budget and chunked prefill, preemption, the room for prefill rows beside decodes, and priorities
(admission order, preemption order, aging) on an injected clock. The block manager alone is in
test_block_manager.py, the step-cost model in test_step_cost.py, prefix-cache hits in
test_prefix_cache_blocks.py."""
import pytest

from scheduling import Clock, run, seq, step
from triton_backend.engine import FinishReason, Request
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.scheduler import Scheduler
from triton_backend.engine.step_cost import keys_of
from triton_backend.engine.sequence import Sequence
from triton_backend.engine.waiting_queue import WaitingQueue


# Budget, chunked prefill, preemption

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


# Room for prefill rows beside decodes (target_itl_ms)

def measured(sched: Scheduler, fixed: float, per_row: float) -> Scheduler:
    """Teach the scheduler's step-cost line `fixed` + `per_row` x rows (seconds)."""
    for _ in range(5):
        for rows in (4, 40):
            sched.step_cost.observe(rows, fixed + per_row * rows)
    return sched


def test_prefill_beside_decodes_is_cut_to_the_room_and_finishes():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = measured(Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms="auto"),
                     0.004, 0.001)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    assert run(sched, 2)[1] == [(i, 1) for i in range(4)]  # prefilled, now decoding
    sched.add(seq(9, 30, max_tokens=2))
    log = run(sched, 3)
    # 4 decode rows take 8 ms; AUTO_ITL_STEPS (3.5) of those steps leave room for 20 more rows
    assert log[0] == [(0, 1), (1, 1), (2, 1), (3, 1), (9, 20)]
    assert [n for step in log for s, n in step if s == 9] == [20, 10, 1]  # then its one decode


def test_before_any_measurement_the_prior_split_sizes_the_room():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms="auto")
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 2)
    sched.add(seq(9, 60, max_tokens=2))
    # (AUTO_ITL_STEPS - 1) x (PRIOR_FIXED_ROWS + 4 decode rows) = 2.5 x 12
    assert run(sched, 1)[0][-1] == (9, 30)


def test_auto_never_cuts_a_prefill_below_the_least_room_but_a_target_in_ms_does():
    """With "auto", beside decodes a prefill goes in chunks of at least `min_prefill_rows` (a
    prompt by slivers costs throughput and TTFT); a target in ms is a promise kept to the row."""
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = measured(Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms="auto",
                               min_prefill_rows=24), 0.004, 0.001)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 2)
    sched.add(seq(9, 30, max_tokens=2))
    sched.add(seq(10, 30, max_tokens=2))
    # 3.5 decode steps would leave 20 rows; the least room is 24, shared, the started one first
    steps = [[(s, n) for s, n in step if s >= 9] for step in run(sched, 3)]
    assert steps == [[(9, 24)], [(9, 6), (10, 18)], [(9, 1), (10, 12)]]
    strict = measured(Scheduler(BlockManager(num_blocks=64, tokens_per_block=4),
                                max_num_tokens=64, max_batch_size=8, target_itl_ms=12,
                                min_prefill_rows=24), 0.004, 0.001)
    for i in range(4):
        strict.add(seq(i, 3, max_tokens=40))
    run(strict, 2)
    strict.add(seq(9, 30, max_tokens=2))
    assert run(strict, 1)[0][-1] == (9, 4)  # 12 ms - the 8 ms decode step: 4 rows


def test_every_prompt_shares_the_room_the_started_one_first():
    """Finish what was started before admitting more: the prefill already running takes the room
    first, arrivals get what it leaves, most urgent first, short prompts included."""
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = measured(Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms="auto"),
                     0.002, 0.001)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 1)  # four decoding rows (6 ms a step): room for 3.5 x 6 - 6 = 15
    decodes = [(i, 1) for i in range(4)]
    sched.add(seq(5, 30, max_tokens=4))
    assert run(sched, 1)[0] == decodes + [(5, 15)]
    sched.add(seq(6, 8, max_tokens=4))
    sched.add(seq(7, 4, max_tokens=4))
    steps = run(sched, 3)
    assert steps[0] == decodes + [(5, 15)]           # the started prompt takes it all
    assert steps[1] == decodes + [(5, 1), (6, 8), (7, 4)]  # its decode; the arrivals in line
    assert steps[2] == decodes + [(5, 1), (6, 1), (7, 1)]


def test_auto_sets_no_cap_while_as_many_prompts_wait_as_sequences_decode():
    """A burst of arrivals beside few streams goes in within the budget alone (each stream is
    delayed once, not every arrival's first token by more steps); once the streams outnumber
    the prompts still waiting for a first token, the room applies again."""
    bm = BlockManager(num_blocks=128, tokens_per_block=4)
    sched = measured(Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms="auto"),
                     0.002, 0.001)
    sched.add(seq(0, 3, max_tokens=40))
    run(sched, 1)  # one decoding row: room for 3.5 x 3 - 3 = 7 rows
    for i in range(1, 4):
        sched.add(seq(i, 20, max_tokens=40))
    # three arrivals, one stream: the budget alone (63 rows beside the decode)
    assert run(sched, 1)[0] == [(0, 1), (1, 20), (2, 20), (3, 20)]
    for i in range(4, 6):
        sched.add(seq(i, 20, max_tokens=40))
    # two arrivals, four streams (6 ms a step): room for 3.5 x 6 - 6 = 15 rows
    assert run(sched, 1)[0] == [(i, 1) for i in range(4)] + [(4, 15)]
    full = Scheduler(BlockManager(num_blocks=128, tokens_per_block=4), max_num_tokens=64,
                     max_batch_size=2, target_itl_ms="auto")
    full = measured(full, 0.002, 0.001)
    full.add(seq(0, 3, max_tokens=40))
    run(full, 1)
    for i in range(1, 5):
        full.add(seq(i, 40, max_tokens=40))
    # one slot left in the batch: one arrival is admissible, one stream decodes: no cap
    assert run(full, 1)[0] == [(0, 1), (1, 40)]


def test_a_target_in_ms_sizes_the_room_from_the_measured_step_cost():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=8, target_itl_ms=88)
    for _ in range(10):  # a memory-bound step: 40 ms whatever the rows, plus 1 ms per row
        sched.step_cost.observe(4, 0.044)
        sched.step_cost.observe(8, 0.048)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=40))
    run(sched, 1)
    sched.add(seq(9, 60, max_tokens=2))
    assert run(sched, 1)[0][-1] == (9, 44)  # 88 ms - the 44 ms decode step leaves 44 rows
    auto = Scheduler(BlockManager(num_blocks=64, tokens_per_block=4), max_num_tokens=64,
                     max_batch_size=8, target_itl_ms="auto")
    auto.step_cost = sched.step_cost
    for i in range(4):
        auto.add(seq(i, 3, max_tokens=40))
    run(auto, 1)
    auto.add(seq(9, 200, max_tokens=2))
    assert run(auto, 1)[0][-1] == (9, 60)  # 3.5 x 44 ms leaves 110 rows: the budget's 60 left


def test_a_target_in_ms_takes_fewer_rows_deep_in_a_long_prompt():
    """Each row of a chunk deep in a prompt attends more keys: with a measured per-key cost the
    chunks shrink as the prompt goes in, each the largest the target allows (a line alone cut
    them all alike and overshot the target at the prompt's tail)."""
    target = 0.040
    sched = Scheduler(BlockManager(num_blocks=128, tokens_per_block=4), max_num_tokens=256,
                      max_batch_size=8, target_itl_ms=target * 1000)
    cost = (0.004, 0.001, 2e-6)  # fixed, per row, per key
    for start in (0, 100, 200, 300) * 3:
        for rows, keys in ((4, 40), (44, 40 + keys_of(start, 40))):
            sched.step_cost.observe(rows, cost[0] + cost[1] * rows + cost[2] * keys, keys)
    assert sched.step_cost.fit() == tuple(pytest.approx(c) for c in cost)
    for i in range(4):
        sched.add(seq(i, 3, max_tokens=80))
    run(sched, 1)
    sched.add(seq(9, 400, max_tokens=2))
    chunks, decodes = [], []
    while not chunks or sum(n for _, n in chunks) < 400:
        out = step(sched)
        decodes = [c for c in out.chunks if c.seq_id != 9]
        (chunk,) = [c for c in out.chunks if c.seq_id == 9]
        chunks.append((chunk.num_computed_tokens, len(chunk.new_token_ids)))
        rows, keys = 4 + len(chunk.new_token_ids), out.num_keys
        assert sched.step_cost.predict(rows, keys) <= target  # the promise is kept ...
        if sum(n for _, n in chunks) < 400:  # ... by the largest chunk that keeps it
            more = keys + chunk.num_computed_tokens + len(chunk.new_token_ids) + 1
            assert sched.step_cost.predict(rows + 1, more) > target
    sizes = [n for _, n in chunks]
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True) and sizes[0] > sizes[-2] + 2
    assert len(decodes) == 4


def test_no_cap_without_decodes_or_without_a_target():
    bm = BlockManager(num_blocks=64, tokens_per_block=4)
    sched = Scheduler(bm, max_num_tokens=16, max_batch_size=8, target_itl_ms="auto")
    sched.add(seq(1, 40, max_tokens=2))
    assert run(sched, 1) == [[(1, 16)]]  # nothing decodes: the whole budget
    off = Scheduler(BlockManager(num_blocks=64, tokens_per_block=4), max_num_tokens=16,
                    max_batch_size=8, target_itl_ms=0)
    off.add(seq(1, 3, max_tokens=40))
    run(off, 1)
    off.add(seq(2, 40, max_tokens=2))
    assert run(off, 1) == [[(1, 1), (2, 15)]]


# Priorities

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


def two_on_three_blocks() -> tuple[Scheduler, Clock, Sequence, Sequence]:
    """Two 2-token prompts that will want 4 blocks of 2 on a pool of 3 (one gets preempted)."""
    sched, clock = scheduler(num_blocks=3, tokens_per_block=2, max_num_tokens=16,
                             max_batch_size=2)
    a, b = seq(1, max_tokens=3), seq(2, max_tokens=3)
    sched.add(a)
    sched.add(b)
    return sched, clock, a, b


def test_a_preempted_sequence_goes_back_by_its_urgency():
    sched, clock, a, b = two_on_three_blocks()
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
    sched, clock, a, b = two_on_three_blocks()
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

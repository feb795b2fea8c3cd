"""Prefix caching in the block manager and the scheduler, on tiny pools with exact block ids
(pure Python: no torch, no model)."""
import pytest

from scheduling import run, seq
from triton_backend.engine import FinishReason
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.scheduler import Scheduler
from triton_backend.engine.sequence import Sequence


def cached_bm(num_blocks: int, tokens_per_block: int = 4, salt: str = "") -> BlockManager:
    return BlockManager(num_blocks, tokens_per_block, enable_prefix_caching=True, cache_salt=salt)


def admit(bm: BlockManager, s: Sequence) -> int:
    """What the scheduler does at admission: reuse the cached prefix, allocate the rest."""
    cached = bm.find_cached_prefix(s)
    num_new = s.num_tokens - len(cached) * bm.tokens_per_block
    assert bm.can_allocate(s, num_new, cached)
    bm.allocate(s, num_new, cached)
    s.num_computed_tokens = len(cached) * bm.tokens_per_block
    return len(cached)


def test_a_freed_sequence_leaves_its_full_blocks_cached_for_the_next():
    bm = cached_bm(8)
    a = seq(1, range(1, 11))            # 10 tokens: blocks 0, 1 full, block 2 partial
    assert admit(bm, a) == 0 and a.block_table == [0, 1, 2]
    assert bm.num_cached_blocks == 2     # full blocks join the cache when allocated
    bm.free(a)
    assert list(bm.reusable_block_ids) == [1, 0]  # tail first: evicted before the head
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2]
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    b = seq(2, list(range(1, 10)) + [99, 98])  # shares 9 tokens = 2 full blocks
    assert bm.find_cached_prefix(b) == [0, 1]
    assert admit(bm, b) == 2
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert b.num_reused_blocks == 2 and b.num_new_blocks == 1
    assert bm.ref_counts[:4] == [1, 1, 0, 1] and not bm.reusable_block_ids


def test_shared_blocks_are_held_by_reference_counts():
    bm = cached_bm(8)
    a, b = seq(1, range(1, 10)), seq(2, list(range(1, 9)) + [50, 51, 52])
    admit(bm, a)
    assert admit(bm, b) == 2              # a still runs: its blocks are shared
    assert a.block_table[:2] == b.block_table[:2] == [0, 1]
    assert bm.ref_counts[0] == bm.ref_counts[1] == 2
    bm.free(a)
    assert bm.ref_counts[:2] == [1, 1] and not bm.reusable_block_ids
    bm.free(b)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8
    assert set(bm.reusable_block_ids) == {0, 1}


def test_a_fully_cached_prompt_still_computes_its_last_block():
    bm = cached_bm(8)
    prompt = list(range(1, 9))            # exactly two full blocks
    a = seq(1, prompt)
    admit(bm, a)
    bm.free(a)
    b = seq(2, prompt)
    # Block 1 holds the last token, whose logits are needed: it is computed again, into a
    # fresh block (a cached block is never written).
    assert bm.find_cached_prefix(b) == [0]
    admit(bm, b)
    assert b.num_computed_tokens == 4 and b.block_table == [0, 2]
    c = seq(3, prompt[:5])                # one full block + 1 token
    assert bm.find_cached_prefix(c) == [0]


def test_the_hash_chain_needs_the_same_prefix_and_the_same_salt():
    bm = cached_bm(8)
    a = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    # Block [5, 6, 7, 8] after another first block is another block.
    assert bm.find_cached_prefix(seq(2, [9, 9, 9, 9, 5, 6, 7, 8, 1])) == []
    assert bm.find_cached_prefix(seq(3, [1, 2, 3, 4, 5, 6, 7, 0, 1])) == [0]
    # Another engine or KV cache format salts the chain: the same tokens hash differently.
    same_tokens = [seq(4, range(1, 10)), seq(5, range(1, 10))]
    hashes = [m._full_block_hashes(s, 2) for m, s in zip((bm, cached_bm(8, salt="kv=int8")),
                                                          same_tokens)]
    assert hashes[0] == bm._full_block_hashes(a, 2) and hashes[0][0] != hashes[1][0]


def test_a_hash_whose_tokens_differ_is_not_a_hit():
    bm = cached_bm(4)
    a = seq(1, [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    # Forge a collision: block 0 claims other tokens than the hash was made of.
    bm.block_tokens[0] = (7, 7, 7, 7)
    assert bm.find_cached_prefix(seq(2, [1, 2, 3, 4, 5])) == []


def test_cached_blocks_are_evicted_least_recently_released_first_only_when_needed():
    bm = cached_bm(4)
    a, b = seq(1, [1, 2, 3, 4, 5]), seq(2, [6, 7, 8, 9, 10])
    admit(bm, a)                          # blocks 0 (cached), 1
    admit(bm, b)                          # blocks 2 (cached), 3
    bm.free(a)
    bm.free(b)
    assert list(bm.reusable_block_ids) == [0, 2] and list(bm.free_block_ids) == [1, 3]
    c = seq(3, [20, 21, 22, 23, 24, 25])  # needs 2 blocks: the free list has exactly 2
    admit(bm, c)
    assert c.block_table == [1, 3] and bm.num_evictions == 0 and bm.num_cached_blocks == 3
    d = seq(4, [30, 31, 32])              # the free list is empty: evict a's block 0 (older)
    admit(bm, d)
    assert d.block_table == [0] and bm.num_evictions == 1
    assert bm.find_cached_prefix(seq(5, [1, 2, 3, 4, 5])) == []
    assert bm.find_cached_prefix(seq(6, [6, 7, 8, 9, 10])) == [2]


def test_reusing_a_released_block_makes_it_recent_again():
    bm = cached_bm(3)
    a, b = seq(1, [1, 2, 3, 4, 0]), seq(2, [5, 6, 7, 8, 0])
    admit(bm, a)
    bm.free(a)
    admit(bm, b)
    bm.free(b)
    assert list(bm.reusable_block_ids) == [0, 2]
    again = seq(3, [1, 2, 3, 4, 9])       # reuses block 0, then releases it: now the latest
    admit(bm, again)
    bm.free(again)
    assert list(bm.reusable_block_ids) == [2, 0]


def test_can_allocate_counts_reused_blocks_that_leave_the_pool():
    bm = cached_bm(3)
    a = seq(1, [1, 2, 3, 4, 5])
    admit(bm, a)                          # blocks 0 (cached), 1
    bm.free(a)
    holder = seq(2, [40, 41, 42])
    admit(bm, holder)                     # from the free list (block 1 went back to it last)
    assert holder.block_table == [2]
    b = seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # reuses block 0 and needs 2 more: only 1 left
    cached = bm.find_cached_prefix(b)
    assert cached == [0] and bm.num_free_blocks == 2
    assert not bm.can_allocate(b, 5, cached)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 5, cached)
    assert bm.ref_counts == [0, 0, 1] and b.block_table == []  # nothing taken
    assert bm.can_allocate(b, 4, cached)


def test_duplicate_content_keeps_one_cached_block():
    bm = cached_bm(8)
    a, b = seq(1, [1, 2, 3]), seq(2, [1, 2, 3])
    admit(bm, a)
    admit(bm, b)                          # nothing cached yet: both hold block-sized partials
    for s in (a, b):                      # both decode the same token into a full block
        s.num_computed_tokens = 3
        s.token_ids.append(4)
        bm.allocate(s, 1)
    assert bm.num_cached_blocks == 1 and bm.block_hashes[a.block_table[0]] is not None
    assert bm.block_hashes[b.block_table[0]] is None
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids)[-1] == 1 and list(bm.reusable_block_ids) == [0]


# -- the scheduler -----------------------------------------------------------------------------
def test_scheduler_admits_from_the_cached_prefix_and_counts_hits():
    bm = cached_bm(16)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=4)
    system = list(range(100, 112))        # 3 full blocks shared
    sched.add(seq(1, system + [1, 2], max_tokens=2))
    assert run(sched, 2, computed=True) == [[(1, 0, 14)], [(1, 14, 1)]]
    sched.add(seq(2, system + [3], max_tokens=1))
    sched.add(seq(3, system + [4, 5, 6, 7, 8], max_tokens=1))
    assert run(sched, 1, computed=True) == [[(2, 12, 1), (3, 12, 5)]]
    assert sched.num_prefix_queried_tokens == 14 + 13 + 17
    assert sched.num_prefix_hit_tokens == 24
    # 3 shared blocks + seq 3's fourth; seq 1's 16th token was never computed, so its fourth
    # block never filled.
    assert not sched.has_work() and bm.num_free_blocks == 16 and bm.num_cached_blocks == 4


def test_a_sequence_admitted_in_the_same_step_reuses_blocks_computed_in_it():
    bm = cached_bm(16)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=4)
    system = list(range(100, 108))
    sched.add(seq(1, system + [1], max_tokens=1))
    sched.add(seq(2, system + [2], max_tokens=1))
    assert run(sched, 1, computed=True) == [[(1, 0, 9), (2, 8, 1)]]
    assert bm.num_free_blocks == 16


def test_preempted_sequence_recomputes_from_its_own_cached_blocks():
    bm = cached_bm(4, tokens_per_block=2)
    sched = Scheduler(bm, max_num_tokens=16, max_batch_size=4)
    old, young = seq(1, [1, 2, 3], max_tokens=4), seq(2, [4, 5, 6], max_tokens=4)
    sched.add(old)
    sched.add(young)
    assert run(sched, 1, computed=True) == [[(1, 0, 3), (2, 0, 3)]]
    assert old.block_table == [0, 1] and young.block_table == [2, 3]
    # Both decode their 4th token into the blocks they hold; the 5th needs a new block each.
    run(sched, 1, computed=True)
    assert run(sched, 1, computed=True) == [[(1, 4, 1)]] and sched.num_preemptions == 1
    # young's blocks were released tail first; old's new block evicted the least recent (3).
    assert young.block_table == [] and list(bm.reusable_block_ids) == [2]
    assert old.block_table == [0, 1, 3] and bm.num_evictions == 1
    run(sched, 1, computed=True)                        # old finishes (4 tokens) and frees its blocks
    assert old.is_finished
    # young comes back: block 2 (tokens 4, 5) is still cached; it recomputes from token 2.
    assert run(sched, 1, computed=True) == [[(2, 2, 3)]]
    assert young.num_reused_blocks == 1
    while sched.has_work():
        run(sched, 1, computed=True)
    assert young.generated_token_ids == [7, 7, 7, 7]
    assert bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4


def test_abort_keeps_computed_blocks_cached_and_frees_the_rest():
    bm = cached_bm(8)
    sched = Scheduler(bm, max_num_tokens=64, max_batch_size=4)
    running = seq(1, range(1, 11), max_tokens=8)
    sched.add(running)
    run(sched, 1, computed=True)
    sched.abort(running, FinishReason.CANCELLED)
    assert bm.num_free_blocks == 8 and bm.num_reusable_blocks == 2 and not sched.has_work()
    again = seq(2, range(1, 11), max_tokens=1)
    sched.add(again)
    assert run(sched, 1, computed=True) == [[(2, 8, 2)]]

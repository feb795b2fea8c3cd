"""The block manager on tiny pools, with exact block ids (no torch, no model); the scheduler's
tests are in test_scheduler.py."""
import pytest

from scheduling import seq
from triton_backend.engine.block_manager import BlockManager


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

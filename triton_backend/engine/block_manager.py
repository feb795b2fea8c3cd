"""The paged KV cache's bookkeeping: fixed-size blocks, a free list and reference counts.

Pure Python (no torch). Sequences get blocks on demand as they grow (`can_allocate` / `allocate`,
a check/act pair) and give them all back the moment they finish, are cancelled or preempted.
"""
from __future__ import annotations

from collections import deque

from triton_backend.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_cache.num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to hold its cached tokens plus `num_new_tokens` more."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks it needs for `num_new_tokens` more. Call `can_allocate` first."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_block_ids):
            raise RuntimeError(f"allocate: {needed} blocks needed, {len(self.free_block_ids)} free")
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (last block first, so recently used ids are reused last)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        """The cache slot holding token `position` of `seq`."""
        block_id = seq.block_table[position // self.tokens_per_block]
        return block_id * self.tokens_per_block + position % self.tokens_per_block

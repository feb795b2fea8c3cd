"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts and the
prefix cache.

Pure Python (no torch). Sequences get blocks on demand as they grow (`can_allocate` / `allocate`,
a check/act pair) and give them all back the moment they finish, are cancelled or preempted.

Prefix caching: a full block is identified by a hash chained over the previous block's hash and
its own token ids (the chain starts from a salt naming the engine and the KV cache format, so
blocks of a differently computed KV can never match; a sequence with a LoRA adapter starts from
that salt chained with its adapter's, since the adapter changes every layer's keys and values). Full blocks are registered in the cache
when they are allocated for the step that computes them: every layer writes the step's keys
before it attends, so even a sequence admitted later in the same step may reuse them. A new
sequence reuses the longest run of cached blocks whose tokens match its own (hashes are confirmed
against the token ids) and computes only the rest. Blocks no sequence holds any more stay cached
("reusable") and are evicted, least recently used first, only when the free list is empty.
Cached blocks are never written again: a sequence writes only past its reused prefix, and at
least its last token is always computed (its logits are needed), so the hit stops one block
short of a prompt that is cached entirely.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from triton_backend.engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block: its parent's hash chained with its token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, *,
                 enable_prefix_caching: bool = False, cache_salt: str = "") -> None:
        if num_blocks < 1:
            raise ValueError(f"kv_cache.num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = hashlib.sha256(cache_salt.encode()).digest()
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Cached blocks no sequence holds, least recently released first (the eviction order).
        self.reusable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.cached_block_ids: dict[bytes, int] = {}      # block hash -> block id
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free list plus the reusable cached blocks."""
        return len(self.free_block_ids) + len(self.reusable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV is in the prefix cache, held by a sequence or not."""
        return len(self.cached_block_ids)

    @property
    def num_reusable_blocks(self) -> int:
        return len(self.reusable_block_ids)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # -- the prefix cache ------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`'s tokens, in order (nothing is taken).

        Stops one block short of a sequence whose every token is cached: the last token must be
        computed to produce logits, and it must not be written into a shared block."""
        if not self.enable_prefix_caching:
            return []
        tpb = self.tokens_per_block
        hit: list[int] = []
        for i, h in enumerate(self._full_block_hashes(seq, (seq.num_tokens - 1) // tpb)):
            block_id = self.cached_block_ids.get(h)
            if block_id is None or self.block_tokens[block_id] != tuple(
                    seq.token_ids[i * tpb:(i + 1) * tpb]):
                break
            hit.append(block_id)
        return hit

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `num_blocks` full blocks (kept on the sequence: its tokens
        never change, only grow)."""
        tpb, hashes = self.tokens_per_block, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root(seq)
            hashes.append(block_hash(parent, seq.token_ids[i * tpb:(i + 1) * tpb]))
        return hashes[:num_blocks]

    def _root(self, seq: Sequence) -> bytes:
        """Where `seq`'s hash chain starts: the engine's salt, chained with its adapter's."""
        if not seq.lora_salt:
            return self.root_hash
        return hashlib.sha256(self.root_hash + b"lora:" + seq.lora_salt.encode()).digest()

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Enter `seq`'s blocks that the first `num_tokens` tokens fill into the cache. A block
        whose content is cached already (computed twice by sequences that ran side by side)
        stays out, so one hash always names one block."""
        num_full = min(num_tokens, seq.num_tokens) // self.tokens_per_block
        if num_full <= seq.num_registered_blocks:
            return
        tpb = self.tokens_per_block
        hashes = self._full_block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[i]
            if self.block_hashes[block_id] is None and hashes[i] not in self.cached_block_ids:
                self.cached_block_ids[hashes[i]] = block_id
                self.block_hashes[block_id] = hashes[i]
                self.block_tokens[block_id] = tuple(seq.token_ids[i * tpb:(i + 1) * tpb])
        seq.num_registered_blocks = num_full

    # -- allocation ------------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          cached: list[int] | None = None) -> int:
        """Blocks `seq` lacks to hold its computed tokens (or the cached prefix `cached`, for a
        sequence that holds no blocks yet) plus `num_new_tokens` more."""
        if cached:
            return self.blocks_for_tokens(len(cached) * self.tokens_per_block
                                          + num_new_tokens) - len(cached)
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     cached: list[int] | None = None) -> bool:
        if not cached and (seq.num_computed_tokens + num_new_tokens
                           <= len(seq.block_table) * self.tokens_per_block):
            return True  # room in the blocks it holds (a decode, most steps)
        # Reusing a cached block nobody holds takes it off the pool as well.
        taken = sum(1 for block_id in cached or () if self.ref_counts[block_id] == 0)
        return self.num_blocks_needed(seq, num_new_tokens, cached) + taken <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> None:
        """Give `seq` the cached prefix `cached` (from `find_cached_prefix`, for a sequence that
        holds no blocks) and the blocks it needs for `num_new_tokens` more; full blocks among
        the tokens this makes room for join the cache. Call `can_allocate` first.

        The caller sets `num_computed_tokens` to the cached prefix's length."""
        if not cached and (seq.num_computed_tokens + num_new_tokens
                           <= len(seq.block_table) * self.tokens_per_block):
            if self.enable_prefix_caching:  # no new block; one may have filled up
                self._register_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
            return
        if not self.can_allocate(seq, num_new_tokens, cached):
            raise RuntimeError(f"allocate: {self.num_blocks_needed(seq, num_new_tokens, cached)} "
                               f"blocks needed, {self.num_free_blocks} free")
        start = seq.num_computed_tokens
        if cached:
            if seq.block_table:
                raise RuntimeError("allocate: a cached prefix is for a sequence holding no blocks")
            for block_id in cached:
                self._hold(block_id)
            seq.block_table.extend(cached)
            seq.num_registered_blocks = len(cached)
            seq.num_reused_blocks += len(cached)
            start = len(cached) * self.tokens_per_block
        for _ in range(self.blocks_for_tokens(start + num_new_tokens) - len(seq.block_table)):
            block_id = self._take_free_block()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
            seq.num_new_blocks += 1
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start + num_new_tokens)

    def _hold(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.reusable_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        block_id, _ = self.reusable_block_ids.popitem(last=False)  # evict the least recent
        block_hash = self.block_hashes[block_id]
        assert block_hash is not None, "a reusable block is a cached block: it has a hash"
        del self.cached_block_ids[block_hash]
        self.block_hashes[block_id] = self.block_tokens[block_id] = None
        self.num_evictions += 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. The last block goes first: recently used ids are
        reused last, and a sequence's tail (least likely shared) is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is not None:
                    self.reusable_block_ids[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_registered_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The cache slot holding token `position` of `seq`."""
        block_id = seq.block_table[position // self.tokens_per_block]
        return block_id * self.tokens_per_block + position % self.tokens_per_block

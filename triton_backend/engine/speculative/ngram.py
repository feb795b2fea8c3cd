"""Prompt-lookup (n-gram) drafting: no second model, just the sequence's own tokens.

If the last `n` tokens occurred before (in the prompt or the output so far), the tokens that
followed them then are proposed as what follows now: text that copies its input (summaries,
rewrites, code edits, quotes) is drafted well. The longest `n` in [min_n, max_n] that matches
wins, and its most recent earlier occurrence. Pure Python.
"""
from __future__ import annotations

from triton_backend.engine.sequence import Sequence


class NgramIndex:
    """Where each n-gram of one sequence last ended, built incrementally as tokens are appended.

    `positions[n][gram]` is the position just after the latest occurrence of `gram` among the
    n-grams that end before the sequence's last token (so the suffix never matches itself)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.positions: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in the maps

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        last = len(token_ids)
        while self.num_indexed < last - 1:
            end = self.num_indexed + 1
            for n, grams in self.positions.items():
                if end >= n:
                    grams[tuple(token_ids[end - n:end])] = end
            self.num_indexed = end
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            start = self.positions[n].get(tuple(token_ids[last - n:]))
            if start is not None:
                return token_ids[start:start + num_tokens]
        return []


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], max_drafts: dict[int, int]) -> None:
        """Set `draft_token_ids` of every sequence in `seqs` (at most `max_drafts[seq_id]`)."""
        for seq in seqs:
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
            seq.draft_token_ids = index.propose(seq.token_ids, max_drafts[seq.seq_id])

    def release(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

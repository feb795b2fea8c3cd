"""One sequence's place in its grammar. Pure Python (no torch).

Invariant: the matcher has consumed exactly the sequence's generated tokens, end ids aside
(`num_consumed`). `Sequence.append_token` advances it with every token the sequence keeps,
accepted drafts included, so a stop inside an accepted run leaves nothing behind. Should the two
ever disagree (a recompute that changed the tokens), `sync` starts the matcher again from its
initial state and replays the tokens the sequence has.
"""
from __future__ import annotations

import numpy as np


class GrammarRejected(RuntimeError):
    """A kept token the grammar does not allow: the masks and the grammar disagree (a bug)."""


class GrammarState:
    def __init__(self, matcher, engine_eos_ids: frozenset[int], mask_vocab_size: int) -> None:
        self.matcher = matcher
        self.mask_vocab_size = mask_vocab_size  # the grammar's vocabulary (>= the logits' width)
        self.engine_eos_ids = engine_eos_ids  # the ids the grammar itself treats as its end
        self.num_consumed = 0
        self.num_resyncs = 0

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise GrammarRejected(f"guided decoding: token {token_id} is not allowed by the "
                                  f"grammar ({self.matcher.get_error()})")
        self.num_consumed += 1

    def is_complete(self) -> bool:
        """True when the grammar allows nothing more (only its end)."""
        return self.matcher.is_stopped()

    def sync(self, generated: list[int], end_ids: frozenset[int]) -> None:
        """Make the matcher's state that after `generated` (end ids skipped)."""
        tokens = [t for t in generated if t not in end_ids]
        if len(tokens) == self.num_consumed:
            return
        self.matcher.reset()
        self.num_consumed = 0
        self.num_resyncs += 1
        for token in tokens:
            self.accept(token)

    def fill_rows(self, mask: np.ndarray, first_row: int, drafts: list[int]) -> None:
        """Masks of the rows that predict the next token and, for each draft, the token after
        it: row `first_row + i` is the state after `drafts[:i]`. A draft the grammar rejects
        ends the run: the rows after it repeat the mask that rejects it, and the verifier stops
        there. The matcher is left where it was."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, mask, first_row)
        num_valid = self.matcher.validate_tokens(drafts) if drafts else 0
        consumed = 0
        for i in range(1, len(drafts) + 1):
            if i <= num_valid and self.matcher.consume_token(drafts[i - 1]):
                consumed += 1
                fill_next_token_bitmask(self.matcher, mask, first_row + i)
            else:
                mask[first_row + i] = mask[first_row + consumed]
        if consumed:
            self.matcher.rollback(consumed)

"""Speculative decoding's engine side: after each step, drafts for the sequences that decode next.

The scheduler puts a sequence's drafts behind its last token, the runner verifies them
(`verifier.py`) and the scheduler appends what was accepted. Speculation pays when a step is
bound by reading the weights (small batches: verifying k tokens costs about one decode); in a
big batch the step is bound by arithmetic and every rejected draft is wasted work, so drafting
pauses while more than `disable_by_batch_size` sequences run.
"""
from __future__ import annotations

from triton_backend.engine.config import SpeculativeConfig
from triton_backend.engine.sequence import Sequence


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.num_paused_steps = 0

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft_token_ids` for the running sequences whose next step is a decode."""
        if len(running) > self.config.disable_by_batch_size:
            self.num_paused_steps += 1
            for seq in running:
                seq.draft_token_ids = []
            return
        decoding, room = [], {}
        for seq in running:
            if seq.num_computed_tokens == seq.num_tokens - 1 and seq.draft_room > 0:
                decoding.append(seq)
                room[seq.seq_id] = min(seq.draft_room, self.config.num_draft_tokens)
            else:
                seq.draft_token_ids = []
        if decoding:
            self.proposer.propose(decoding, room)

    def release(self, seq_id: int) -> None:
        self.proposer.release(seq_id)

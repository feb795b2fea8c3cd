"""In-flight batching: which sequences run this step, and how many tokens each, within a budget.

There are no separate prefill and decode phases: every sequence has `num_computed_tokens`
catching up with `num_tokens`. Each step first continues the running sequences (decodes and
unfinished prefill chunks, oldest first), then admits waiting ones while the token budget
(`max_num_tokens`), the batch size (`max_batch_size`) and the free blocks allow. When a running
sequence needs a block and none is free, the youngest running sequence is preempted: its blocks
go back to the pool and it is recomputed later from its tokens (never dropped).

Pure Python (no torch).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.request import FinishReason, Request
from triton_backend.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: feed `new_token_ids` at positions from `num_computed_tokens`."""

    seq_id: int
    new_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    needs_sample: bool        # the chunk reaches the sequence's end: sample the next token
    request: Request
    token_ids: list[int]      # the whole sequence so far (for penalties and bad words)
    num_prompt_tokens: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.new_token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_tokens: int, max_batch_size: int) -> None:
        self.block_manager = block_manager
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.max_num_tokens)
        if not output.preempted_seq_ids:  # blocks are short: admitting now would only churn
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            seq = self.running.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                if not self.running:  # seq itself is the youngest left: it yields
                    self._preempt(seq, output)
                    break
                self._preempt(self.running.pop(), output)
            else:
                self.block_manager.allocate(seq, num_new)
                output.chunks.append(self._chunk(seq, num_new))
                scheduled.append(seq)
                budget -= num_new
        self.running = scheduled + self.running
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.chunks.append(self._chunk(seq, num_new))
            budget -= num_new

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id, new_token_ids=seq.token_ids[start:start + num_new],
            num_computed_tokens=start, block_table=list(seq.block_table),
            needs_sample=start + num_new == seq.num_tokens, request=seq.request,
            token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        output.preempted_seq_ids.append(seq.seq_id)

    def update(self, output: SchedulerOutput, sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """Advance the scheduled sequences; `sampled` maps seq_id -> (token id, log prob).

        Returns the sequences that finished this step (their blocks are already free)."""
        by_id = {seq.seq_id: seq for seq in self.running}
        finished = []
        for chunk in output.chunks:
            seq = by_id[chunk.seq_id]
            seq.num_computed_tokens += len(chunk.new_token_ids)
            if chunk.needs_sample:
                token_id, log_prob = sampled[chunk.seq_id]
                seq.append_token(token_id, log_prob)
                if seq.finish_reason is not None:
                    self._finish(seq)
                    finished.append(seq)
        return finished

    def abort(self, seq: Sequence, reason: FinishReason) -> None:
        """Take `seq` out wherever it is (waiting or running) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

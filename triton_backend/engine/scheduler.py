"""In-flight batching: which sequences run this step, and how many tokens each, within a budget.

There are no separate prefill and decode phases: every sequence has `num_computed_tokens`
catching up with `num_tokens`. Each step first continues the running sequences (decodes and
unfinished prefill chunks, most urgent first), then admits waiting ones, most urgent first, while
the token budget (`max_num_tokens`), the batch size (`max_batch_size`) and the free blocks allow.
When a running sequence needs a block and none is free, the least urgent running sequence is
preempted: its blocks go back to the pool and it is recomputed later from its tokens (never
dropped). Urgency is the request's priority aged by its wait (`waiting_queue.urgency_key`); with
equal priorities it is arrival order: oldest first, youngest preempted. Admission never preempts.

With prefix caching, a sequence being admitted (first time or after a preemption) starts from
the longest cached prefix of its tokens: `num_computed_tokens` starts there and only the rest is
scheduled. With speculative decoding, a decoding sequence carries draft tokens proposed after
the previous step; they are scheduled behind its last token when the budget and the free blocks
allow (speculation never preempts anyone), verified in the same forward pass, and `update` appends
the accepted ones.

While sequences decode, every prefill shares the room the target inter-token latency leaves
(`limits.target_itl_ms`): the step-cost model predicts how many rows a step may carry and stay
within it (fewer deep in a long prompt, where each row attends more keys); the prefills already
started take the room first (finish what was started before admitting more), then arrivals,
most urgent first. With "auto" the target is AUTO_ITL_STEPS
decode-only steps of the batch at hand, and the room is never below `min_prefill_rows`
(AUTO_MIN_PREFILL_ROWS in the engine): on a compute-bound CPU every step pays its weights and its
Python whatever its rows, and a request whose prompt goes in by slivers stays out of the decoding
batch longer, so chunks of hundreds of rows keep the throughput and the TTFT of whole prompts
while the streams beside them never wait for more than one chunk. And "auto" sets no cap while
at least as many prompts wait for their first token as sequences decode (a burst of arrivals
beside a few streams): a longer step delays each decoding stream once, where slices would delay
every waiting prompt's first token by more steps and every stream by as many longer steps (16
prompts of 128 ids arriving beside one stream went in 2 at a time: eight slow steps in a row for
the streams admitted first). An explicit target in ms is kept to the row. With nothing decoding,
a prompt takes the whole `max_num_tokens` budget.

Pure Python (no torch).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.config import AUTO_ITL_STEPS
from triton_backend.engine.request import FinishReason, Request
from triton_backend.engine.sequence import Sequence, SequenceStatus
from triton_backend.engine.step_cost import StepCostModel, keys_of
from triton_backend.engine.waiting_queue import WaitingQueue

DEFAULT_AGING_RATE = 1.0  # priority levels a waiting request gains per second


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: feed `new_token_ids` at positions from `num_computed_tokens`.
    `block_table` and `token_ids` are the sequence's own lists (no copy per step): valid until the
    step's `update`, which may grow or free them."""

    seq_id: int
    new_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    needs_sample: bool        # the chunk reaches the sequence's end: sample the next token
    request: Request
    token_ids: list[int]      # the whole sequence so far (for penalties and bad words)
    num_prompt_tokens: int
    num_draft_tokens: int = 0  # the last new_token_ids are drafts to verify (after the real ones)
    grammar: object | None = None  # the sequence's GrammarState (guided decoding), else None
    lora_task_id: int | None = None  # the adapter of its rows (None: the base model)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.new_token_ids) for c in self.chunks)

    @property
    def num_keys(self) -> int:
        """(row, key) pairs the step's attention reads (the step-cost plane's second term)."""
        return sum(keys_of(c.num_computed_tokens, len(c.new_token_ids)) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """`clock` returns wall-clock ns (injected by tests); it stamps arrivals the requests did not
    carry and first admissions."""

    def __init__(self, block_manager: BlockManager, max_num_tokens: int, max_batch_size: int,
                 priority_aging_rate: float = DEFAULT_AGING_RATE,
                 clock: Callable[[], int] = time.time_ns,
                 target_itl_ms: float | str = 0,
                 max_loras: int | None = None, min_prefill_rows: int = 0) -> None:
        """`max_loras`: the most distinct LoRA adapters one step may run (None: no adapters).
        `min_prefill_rows`: with the "auto" target, the least room a step beside decodes leaves
        for prefills."""
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.clock = clock
        # Prefill rows a step may carry while others decode (0: the budget alone), from the
        # step times the engine reports to `step_cost`.
        self.target_itl_ms = target_itl_ms
        self.min_prefill_rows = min_prefill_rows
        self.step_cost = StepCostModel()
        self._prefill_room: int | None = None
        self.waiting = WaitingQueue(priority_aging_rate)
        self.running: list[Sequence] = []  # most urgent first
        self.num_preemptions = 0
        # Prefix cache lookups at admission: tokens asked for and tokens found cached.
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        if seq.arrival_ns is None:
            seq.arrival_ns = self.clock()
        self.waiting.push(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self._prefill_room = self._room_beside_decodes()
        budget = self._schedule_running(output, self.max_num_tokens)
        if not output.preempted_seq_ids:  # blocks are short: admitting now would only churn
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            seq = self.running.pop(0)
            num_new = self._take_prefill_room(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # a prefill waits for room beside the decodes
                scheduled.append(seq)
                continue
            num_drafts = self._num_draft_tokens(seq, num_new, budget)
            while not self.block_manager.can_allocate(seq, num_new + num_drafts):
                if num_drafts:  # drop the drafts before taking anyone's blocks
                    num_drafts = 0
                    continue
                if not self.running:  # seq itself is the least urgent left: it yields
                    self._preempt(seq, output)
                    break
                self._preempt(self.running.pop(), output)
            else:
                self.block_manager.allocate(seq, num_new + num_drafts)
                output.chunks.append(self._chunk(seq, num_new, num_drafts))
                scheduled.append(seq)
                budget -= num_new + num_drafts
        self.running = scheduled + self.running
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting.peek()
            if not self._adapter_fits(seq):  # it waits until an adapter of the batch is done
                break
            num_new = self._allocate_from_cached_prefix(seq, budget)
            if num_new is None:
                break
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_ns is None:
                seq.scheduled_ns = self.clock()
            bisect.insort(self.running, seq, key=self.waiting.key)
            output.chunks.append(self._chunk(seq, num_new))
            budget -= num_new

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps the running batch within `max_loras` distinct adapters."""
        if seq.lora_task_id is None or self.max_loras is None:
            return True
        running = {s.lora_task_id for s in self.running if s.lora_task_id is not None}
        return seq.lora_task_id in running or len(running) < self.max_loras

    def _room_beside_decodes(self) -> int | None:
        """Prefill rows this step may carry, or None (no cap: nothing decodes, or no target).
        Sized for the first prefill in line (the started ones come first, then the most urgent
        arrival): deep in a long prompt each row attends more keys, so fewer rows fit. With
        "auto" there is no cap either while at least as many prompts wait for their first token
        (started, or admissible now) as sequences decode."""
        if not self.target_itl_ms:
            return None
        decode_rows = decode_keys = decoding = 0
        start = None
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                rows = 1 + len(seq.draft_token_ids)
                decoding += 1
                decode_rows += rows
                decode_keys += keys_of(seq.num_computed_tokens, rows)
            elif start is None:
                start = seq.num_computed_tokens
        if decode_rows == 0:
            return None
        auto = self.target_itl_ms == "auto"
        if auto:
            admissible = min(len(self.waiting), self.max_batch_size - len(self.running))
            if len(self.running) - decoding + admissible >= decoding:
                return None
        seconds = None if auto else float(self.target_itl_ms) / 1000
        room = self.step_cost.extra_rows(decode_rows, seconds, AUTO_ITL_STEPS, decode_keys,
                                         start or 0)
        return max(self.min_prefill_rows, room) if auto else room

    def _take_prefill_room(self, num_left: int, budget: int) -> int:
        """Tokens of a sequence with `num_left` to compute this step may take: within `budget`,
        and for a prefill within the room left beside the decodes, which it uses up."""
        num_new = min(num_left, budget)
        if num_left <= 1 or self._prefill_room is None:
            return num_new
        num_new = min(num_new, self._prefill_room)
        self._prefill_room -= num_new
        return num_new

    def _allocate_from_cached_prefix(self, seq: Sequence, budget: int) -> int | None:
        """Admit `seq` from the longest cached prefix of its tokens: allocate for what is left
        within `budget` (and the prefill room) and return that count, or None (nothing taken)
        when blocks are short or a long prefill finds no room beside the decodes."""
        cached = self.block_manager.find_cached_prefix(seq)
        num_cached = len(cached) * self.block_manager.tokens_per_block
        room_before = self._prefill_room
        num_new = self._take_prefill_room(seq.num_tokens - num_cached, budget)
        if num_new == 0 or not self.block_manager.can_allocate(seq, num_new, cached):
            self._prefill_room = room_before
            return None
        self.block_manager.allocate(seq, num_new, cached)
        seq.num_computed_tokens = num_cached
        self.num_prefix_queried_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += num_cached
        return num_new

    def _num_draft_tokens(self, seq: Sequence, num_new: int, budget: int) -> int:
        """How many of `seq`'s draft tokens fit this step: only behind its last token, within
        the budget, and never more than it may still generate after the target's own token."""
        if not seq.draft_token_ids or seq.num_computed_tokens + num_new != seq.num_tokens:
            return 0
        return max(0, min(len(seq.draft_token_ids), budget - num_new, seq.draft_room))

    def _chunk(self, seq: Sequence, num_new: int, num_drafts: int = 0) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            new_token_ids=seq.token_ids[start:start + num_new] + seq.draft_token_ids[:num_drafts],
            num_computed_tokens=start, block_table=seq.block_table,
            needs_sample=start + num_new == seq.num_tokens, request=seq.request,
            token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
            num_draft_tokens=num_drafts, grammar=seq.grammar, lora_task_id=seq.lora_task_id)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)
        output.preempted_seq_ids.append(seq.seq_id)

    def update(self, output: SchedulerOutput, sampled: dict[int, tuple[int, float]],
               accepted: dict[int, list[tuple[int, float]]] | None = None,
               top: dict[int, list[tuple[list[int], list[float]]]] | None = None
               ) -> list[Sequence]:
        """Advance the scheduled sequences; `sampled` maps seq_id -> (token id, log prob) of the
        next token, `accepted` seq_id -> the draft tokens verification kept, which come before it,
        `top` seq_id -> the alternatives of each of those tokens (accepted ones first).

        Returns the sequences that finished this step (their blocks are already free)."""
        by_id = {seq.seq_id: seq for seq in self.running}
        finished = []
        for chunk in output.chunks:
            seq = by_id[chunk.seq_id]
            kept = accepted.get(chunk.seq_id, []) if accepted else []
            # Rejected drafts' keys stay in the cache past num_computed_tokens, to be overwritten.
            seq.num_computed_tokens += len(chunk.new_token_ids) - chunk.num_draft_tokens + len(kept)
            seq.draft_token_ids = []
            seq.num_draft_tokens += chunk.num_draft_tokens
            seq.num_accepted_tokens += len(kept)
            if chunk.needs_sample:
                alternatives = top.get(chunk.seq_id) if top else None
                for i, (token_id, log_prob) in enumerate(kept + [sampled[chunk.seq_id]]):
                    seq.append_token(token_id, log_prob, alternatives[i] if alternatives else None)
                    if seq.finish_reason is not None:  # a stop inside the accepted run ends it
                        break
                if seq.finish_reason is not None:
                    self._finish(seq)
                    finished.append(seq)
        return finished

    def abort(self, seq: Sequence, reason: FinishReason) -> None:
        """Take `seq` out wherever it is (waiting or running) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.finish_reason = reason
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

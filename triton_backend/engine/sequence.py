"""A request's state inside the engine: its tokens, how many are in the KV cache, its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from triton_backend.engine.request import FinishReason, Request


class Grammar(Protocol):
    """What a sequence asks of its guided-decoding state (`guided.state.GrammarState`)."""

    def accept(self, token_id: int) -> None: ...

    def is_complete(self) -> bool: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """`token_ids` = prompt + generated. The engine catches `num_computed_tokens` up with
    `num_tokens`; when they meet, the step samples a new token (prefill and decode alike)."""

    seq_id: int
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    eos_ids: frozenset[int]
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    log_probs: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # generated tokens already handed out in streaming responses
    # Wall-clock ns: arrival at the server (from the request, else when the scheduler took it)
    # and the first admission to the running batch (None while it never ran).
    arrival_ns: int | None = None
    scheduled_ns: int | None = None
    # Prefix cache: the hashes of its full blocks (by content, so they outlive a preemption), how
    # many leading blocks of `block_table` were offered to the cache, and per-request counters.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_reused_blocks: int = 0     # blocks taken from the prefix cache (over every admission)
    num_new_blocks: int = 0        # blocks allocated afresh
    # Speculative decoding: tokens proposed for the next step, and how drafts fared so far.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Guided decoding: the grammar state (`guided.state.GrammarState`), advanced with every
    # kept token.
    grammar: Grammar | None = None
    # top_log_probs: per generated token, the most likely ids and their raw log probs.
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    # LoRA: the adapter's task id (None: the base model) and what names its weights; the prefix
    # cache's hash chain starts from it, so a block computed with one adapter never serves another.
    lora_task_id: int | None = None
    lora_salt: str = ""

    @classmethod
    def from_request(cls, seq_id: int, request: Request, eos_ids: frozenset[int]) -> "Sequence":
        return cls(seq_id=seq_id, request=request, token_ids=list(request.input_token_ids),
                   num_prompt_tokens=len(request.input_token_ids), eos_ids=eos_ids,
                   arrival_ns=request.arrival_time_ns)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def draft_room(self) -> int:
        """Draft tokens a step could still keep (the target adds one token of its own)."""
        return self.request.max_tokens - self.num_generated_tokens - 1

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, log_prob: float,
                     top: tuple[list[int], list[float]] | None = None) -> None:
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
        if top is not None:
            self.top_ids.append(top[0])
            self.top_log_probs.append(top[1])
        if self.grammar is not None and token_id not in self.eos_ids:
            self.grammar.accept(token_id)
        self.finish_reason = self._check_stop(token_id)

    def _check_stop(self, token_id: int) -> FinishReason | None:
        request = self.request
        generated = self.num_generated_tokens
        below_min = generated < request.sampling.min_tokens
        if not below_min and not request.ignore_eos and token_id in self.eos_ids:
            return FinishReason.END_ID
        if not below_min:
            for stop in request.stop_token_sequences:
                if stop and generated >= len(stop) and self.token_ids[-len(stop):] == stop:
                    return FinishReason.STOP_WORDS
        if self.grammar is not None and self.grammar.is_complete():
            return FinishReason.END_ID  # the grammar allows nothing but its end
        if generated >= request.max_tokens:
            return FinishReason.LENGTH
        return None

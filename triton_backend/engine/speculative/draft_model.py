"""Draft-model drafting: a smaller engine with the target's tokenizer proposes the next tokens.

The draft engine runs inside the target's executor, with its own weights, paged KV cache and
block manager. Each sequence has a draft-side mirror whose `num_computed_tokens` says how much
of its tokens the draft cache holds. Before proposing, the mirror takes the target's tokens and
keeps only the computed prefix they still agree with (a rejected draft's keys are dropped), then
the draft catches up on the rest and proposes greedily, one batched forward pass per draft
token. A greedy proposal is a point mass, which is what the verifier's rejection rule assumes.
When the draft's cache is full a sequence simply gets no drafts (and its mirror is dropped).
"""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.progress import Progress
from triton_backend.engine.request import Request
from triton_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from triton_backend.engine.sequence import Sequence

_GREEDY = Request(input_token_ids=[0], max_tokens=1)  # plain greedy picks, no stop rules


def resolve_draft_engine(engine_dir: Path, draft_engine: str) -> Path:
    """`draft_engine` as config.json holds it: absolute, or relative to the target's directory."""
    path = Path(draft_engine)
    return path if path.is_absolute() else (Path(engine_dir) / path).resolve()


def load_draft_config(engine_dir: Path, config: EngineConfig) -> tuple[Path, EngineConfig]:
    draft_dir = resolve_draft_engine(engine_dir, config.speculative.draft_engine)
    try:
        draft = EngineConfig.load(draft_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"speculative.draft_engine: {exc}") from None
    if draft.target != "torch" or draft.model.vocab_size > config.model.vocab_size:
        raise ValueError(f"speculative.draft_engine: {draft_dir} must be a torch engine with at "
                         f"most the target's vocab_size ({config.model.vocab_size}); got target "
                         f"{draft.target!r}, vocab_size {draft.model.vocab_size}")
    return draft_dir, draft


class DraftModelProposer:
    def __init__(self, engine_dir: Path, config: EngineConfig, device: str = "cpu",
                 progress: Progress | None = None) -> None:
        import torch

        from triton_backend.engine.kv_pool import plan_pool
        from triton_backend.engine.model_runner import ModelRunner
        from triton_backend.engine.weights import runtime_dtype

        draft_dir, draft = load_draft_config(engine_dir, config)
        # As many tokens as the target's own pool could hold (its limits), in the draft's blocks.
        pool = plan_pool(draft, runtime_dtype(draft, torch.device(device)))
        self.runner = ModelRunner(draft_dir, draft, pool, device, progress=progress)
        num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(num_blocks, draft.kv_cache.tokens_per_block)
        self.mirrors: dict[int, Sequence] = {}

    def propose(self, seqs: list[Sequence], max_drafts: dict[int, int]) -> None:
        """Set `draft_token_ids` of every sequence in `seqs` (at most `max_drafts[seq_id]`)."""
        mirrors = [self._sync(seq) for seq in seqs]
        for seq in seqs:
            seq.draft_token_ids = []
        active = list(zip(seqs, mirrors))
        for round_ in range(max(max_drafts.values(), default=0)):
            active = [(s, m) for s, m in active if len(s.draft_token_ids) < max_drafts[s.seq_id]
                      and len(s.draft_token_ids) == round_ and self._make_room(m)]
            if not active:
                return
            chunks = [self._chunk(m) for _, m in active]
            picks = self.runner.run(SchedulerOutput(chunks), {c.seq_id: frozenset()
                                                              for c in chunks}).sampled
            for (seq, mirror), chunk in zip(active, chunks):
                mirror.num_computed_tokens += len(chunk.new_token_ids)
                token = picks[seq.seq_id][0]
                mirror.token_ids.append(token)
                seq.draft_token_ids.append(token)

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft-side mirror of `seq`, holding its tokens and the draft KV still valid."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(seq.seq_id, _GREEDY, [], 0, frozenset())
        agree = 0
        limit = min(mirror.num_computed_tokens, seq.num_tokens)
        while agree < limit and mirror.token_ids[agree] == seq.token_ids[agree]:
            agree += 1
        mirror.num_computed_tokens = agree
        mirror.token_ids = list(seq.token_ids)
        return mirror

    def _make_room(self, mirror: Sequence) -> bool:
        num_new = mirror.num_tokens - mirror.num_computed_tokens
        if self.block_manager.can_allocate(mirror, num_new):
            self.block_manager.allocate(mirror, num_new)
            return True
        self.release(mirror.seq_id)  # no room: this sequence goes without drafts for now
        return False

    def _chunk(self, mirror: Sequence) -> ScheduledChunk:
        start = mirror.num_computed_tokens
        return ScheduledChunk(seq_id=mirror.seq_id, new_token_ids=mirror.token_ids[start:],
                              num_computed_tokens=start, block_table=list(mirror.block_table),
                              needs_sample=True, request=_GREEDY, token_ids=mirror.token_ids,
                              num_prompt_tokens=0)

    def release(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror)

"""The synchronous engine: requests in, one step at a time, responses out.

A step is schedule -> run -> update -> respond. The `Executor` drives it from a background thread;
tests and `forge generate` can drive it directly.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import torch

from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.model_runner import ModelRunner, kv_bytes_per_token
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.scheduler import Scheduler, SchedulerOutput
from triton_backend.engine.sequence import Sequence
from triton_backend.engine.validation import check_kv_capacity, validate_request
from triton_backend.engine.weights import runtime_dtype


def resolve_num_blocks(config: EngineConfig, dtype: torch.dtype, num_kv_blocks: int | None = None,
                       kv_cache_memory_bytes: int | None = None) -> int:
    """Blocks in the KV pool: an explicit count, else a memory budget, else the engine's setting,
    else enough for max_batch_size sequences of max_seq_len tokens."""
    kv = config.kv_cache
    if num_kv_blocks is not None:
        return num_kv_blocks
    budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else kv.memory_bytes
    if budget is None and kv.num_blocks is not None:
        return kv.num_blocks
    if budget is not None:
        block_bytes = kv_bytes_per_token(config, dtype) * kv.tokens_per_block
        return max(1, budget // block_bytes)
    tokens = config.limits.max_batch_size * config.limits.max_seq_len
    return -(-tokens // kv.tokens_per_block)


class LLMEngine:
    def __init__(self, engine_dir: str | Path, *, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, device: str = "cpu") -> None:
        self.engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(engine_dir)
        if self.config.target != "torch":
            raise ValueError(f"{engine_dir}: target {self.config.target!r} engines do not run on "
                             f"the torch runtime")
        self.tokenizer_dir = self.engine_dir / self.config.tokenizer.dir
        limits = self.config.limits
        dtype = runtime_dtype(self.config, torch.device(device))
        num_blocks = resolve_num_blocks(self.config, dtype, num_kv_blocks, kv_cache_memory_bytes)
        self.block_manager = BlockManager(num_blocks, self.config.kv_cache.tokens_per_block)
        self.scheduler = Scheduler(self.block_manager, limits.max_num_tokens, limits.max_batch_size)
        self.runner = ModelRunner(engine_dir, self.config, num_blocks, device)
        self.eos_ids = frozenset(self.config.tokenizer.eos_token_ids)
        self.sequences: dict[int, Sequence] = {}
        self.last_logits: torch.Tensor | None = None  # of the last step, when it was asked for
        self._ids = itertools.count(1)
        self.stats = {"num_steps": 0, "max_num_seqs_in_step": 0, "num_scheduled_tokens": 0,
                      "num_completed_requests": 0, "num_cancelled_requests": 0}

    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and the limit when `request` cannot be served."""
        validate_request(request, self.config.limits, self.config.model.vocab_size)
        check_kv_capacity(request, self.block_manager.num_blocks,
                          self.block_manager.tokens_per_block)

    def add_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and queue `request` under `request_id` (a fresh id when None)."""
        self.validate(request)
        seq_id = next(self._ids) if request_id is None else request_id
        if seq_id in self.sequences:
            raise ValueError(f"request id {seq_id} is already in flight")
        eos = frozenset() if request.ignore_eos else (
            self.eos_ids if request.end_ids is None else frozenset(request.end_ids))
        seq = Sequence.from_request(seq_id, request, eos)
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq_id: int) -> Response | None:
        """Cancel a request: its blocks are freed now; returns its final response."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq, FinishReason.CANCELLED)
        self.runner.sampler.release(seq_id)
        self.stats["num_cancelled_requests"] += 1
        return self._response(seq, final=True)

    def step(self, return_logits: bool = False) -> list[Response]:
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        eos = {c.seq_id: self.sequences[c.seq_id].eos_ids for c in output.chunks if c.needs_sample}
        result = self.runner.run(output, eos, return_logits=return_logits)
        finished = self.scheduler.update(output, result.sampled)
        self._count(output)
        self.last_logits = result.logits
        return self._responses(output, finished)

    def _count(self, output: SchedulerOutput) -> None:
        self.stats["num_steps"] += 1
        self.stats["num_scheduled_tokens"] += output.num_tokens
        self.stats["max_num_seqs_in_step"] = max(self.stats["max_num_seqs_in_step"],
                                                 len(output.chunks))

    def _responses(self, output: SchedulerOutput, finished: list[Sequence]) -> list[Response]:
        responses = []
        done = {seq.seq_id for seq in finished}
        for chunk in output.chunks:
            seq = self.sequences[chunk.seq_id]
            if chunk.seq_id in done:
                responses.append(self._response(seq, final=True))
                del self.sequences[chunk.seq_id]
                self.runner.sampler.release(chunk.seq_id)
                self.stats["num_completed_requests"] += 1
            elif chunk.needs_sample and seq.request.streaming:
                responses.append(self._response(seq, final=False))
        return responses

    def _response(self, seq: Sequence, final: bool) -> Response:
        generated = seq.generated_token_ids
        start = seq.num_sent_tokens if seq.request.streaming else 0
        seq.num_sent_tokens = len(generated)
        return Response(
            request_id=seq.seq_id, output_token_ids=generated[start:], is_final=final,
            finish_reason=seq.finish_reason if final else None,
            log_probs=seq.log_probs[start:] if seq.request.return_log_probs else [],
            cum_log_prob=sum(seq.log_probs), num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(generated))

    def get_stats(self) -> dict:
        return dict(self.stats, num_preemptions=self.scheduler.num_preemptions,
                    num_free_blocks=self.block_manager.num_free_blocks,
                    num_used_blocks=self.block_manager.num_used_blocks,
                    num_total_blocks=self.block_manager.num_blocks,
                    num_active_requests=len(self.scheduler.running),
                    num_waiting_requests=len(self.scheduler.waiting),
                    tokens_per_block=self.block_manager.tokens_per_block,
                    cpp_kernels=int(self.runner.ops.name == "cpp"))

"""The synchronous engine: requests in, one step at a time, responses out.

A step is schedule -> run -> update -> respond. The `Executor` drives it from a background thread;
tests and `forge generate` can drive it directly.

A step that raises ends only the requests it concerns: the rows the sampler could not serve
(`SamplingError`), else every sequence of that step's batch. Nothing else is touched, so the next
step serves everyone else (a failed step never advanced `num_computed_tokens`, so the sequences
that were not ended simply run that step again).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engine import families
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.config import AUTO_MIN_PREFILL_ROWS, EngineConfig
from triton_backend.engine.device import resolve_device
from triton_backend.engine.faults import FaultInjector
from triton_backend.engine.guided.compiler import GrammarCompiler
from triton_backend.engine.guided.state import GrammarState
from triton_backend.engine.lora.cache import AdapterCache
from triton_backend.engine.kv_pool import plan_pool
from triton_backend.engine.model_runner import ModelRunner
from triton_backend.engine.progress import Progress
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.sampler import SamplingError
from triton_backend.engine.scheduler import DEFAULT_AGING_RATE, Scheduler, SchedulerOutput
from triton_backend.engine.sequence import Sequence
from triton_backend.engine.validation import check_kv_capacity, validate_request
from triton_backend.engine.weights import runtime_dtype

log = logging.getLogger(__name__)


def cache_salt(config: EngineConfig) -> str:
    """What the prefix cache's hash chain starts from: everything besides the tokens that
    decides a block's keys and values (the engine, its weights' format, the KV cache format)."""
    q, kv = config.quantization, config.kv_cache
    return (f"{config.name}|{config.dtype}|weights={q.weights}/{q.group_size}|kv={kv.dtype}|"
            f"tokens_per_block={kv.tokens_per_block}")


class LLMEngine:
    """`enable_prefix_caching` / `enable_speculative_decoding`: None follows the engine's
    config.json; False turns the feature off (the repository's off switches).
    `priority_aging_rate`: priority levels a waiting request gains per second (the scheduler's
    aging); `clock`: wall-clock ns, for arrivals and deadlines (injected by tests)."""

    def __init__(self, engine_dir: str | Path, *, kv_cache_num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, device: str | None = None,
                 enable_prefix_caching: bool | None = None,
                 enable_speculative_decoding: bool | None = None,
                 priority_aging_rate: float = DEFAULT_AGING_RATE,
                 kv_cache_free_gpu_mem_fraction: float | None = None,
                 enable_cuda_graphs: bool | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """`device`: None follows the engine's hardware (see device.py); `enable_cuda_graphs`
        False: the GPU backend runs decode steps eagerly."""
        self.engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(engine_dir)
        if self.config.target != "torch":
            raise ValueError(f"{engine_dir}: target {self.config.target!r} engines do not run on "
                             f"the torch runtime")
        self.device = resolve_device(self.config.hardware, device)
        self.tokenizer_dir = self.engine_dir / self.config.tokenizer.dir
        dtype = runtime_dtype(self.config, self.device)
        # Advanced by whatever runs on the loop's thread (see progress.py): the watchdog's signal.
        self.progress = Progress()
        family = families.get(self.config.model.architecture)
        self.lora = (AdapterCache(engine_dir, self.config, dtype, family.lora_parts(),
                                  self.progress) if self.config.lora else None)
        self.speculator = None  # before the runner: a draft model's memory is not the KV pool's
        if self.config.speculative.enabled and enable_speculative_decoding is not False:
            from triton_backend.engine.speculative import make_speculator

            self.speculator = make_speculator(self.engine_dir, self.config, self.device,
                                              self.progress)
        pool = plan_pool(self.config, dtype, self.device, kv_cache_num_blocks,
                         kv_cache_memory_bytes, kv_cache_free_gpu_mem_fraction)
        self.runner = ModelRunner(engine_dir, self.config, pool, self.device, lora=self.lora,
                                  progress=self.progress,
                                  enable_cuda_graphs=enable_cuda_graphs is not False)
        kv = self.config.kv_cache
        self.block_manager = BlockManager(
            self.runner.num_blocks, kv.tokens_per_block,
            enable_prefix_caching=kv.enable_prefix_caching and enable_prefix_caching is not False,
            cache_salt=cache_salt(self.config))
        self.priority_aging_rate, self.clock = priority_aging_rate, clock
        self.scheduler = self._new_scheduler()
        self.eos_ids = frozenset(self.config.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer_dir, self.config.model.vocab_size,
                                        sorted(self.eos_ids))
        self.sequences: dict[int, Sequence] = {}
        self.last_logits: torch.Tensor | None = None  # of the last step, when it was asked for
        self._ids = itertools.count(1)
        self.faults = FaultInjector.from_env(self.progress)
        self.stats = {"num_steps": 0, "max_num_seqs_in_step": 0, "num_scheduled_tokens": 0,
                      "num_completed_requests": 0, "num_cancelled_requests": 0,
                      "spec_num_verify_steps": 0, "spec_num_draft_tokens": 0,
                      "spec_num_accepted_tokens": 0, "num_failed_steps": 0,
                      "num_failed_requests": 0, "num_timed_out_requests": 0}

    def _new_scheduler(self) -> Scheduler:
        limits = self.config.limits
        return Scheduler(self.block_manager, limits.max_num_tokens, limits.max_batch_size,
                         self.priority_aging_rate, self.clock,
                         target_itl_ms=limits.target_itl_ms,
                         max_loras=self.config.lora.max_loras if self.config.lora else None,
                         min_prefill_rows=AUTO_MIN_PREFILL_ROWS)

    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and the limit when `request` cannot be served.
        A guided request's grammar is compiled here (once per distinct guide), so that the step
        loop, which `admit`s it, finds it compiled."""
        self._check(request)
        if request.guided_decoding is not None:
            self.grammars.compile(request.guided_decoding)

    def _check(self, request: Request) -> None:
        validate_request(request, self.config.limits, self.config.model.vocab_size)
        check_kv_capacity(request, self.block_manager.num_blocks,
                          self.block_manager.tokens_per_block)

    def add_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and queue `request` under `request_id` (a fresh id when None)."""
        self._check(request)
        return self.admit(request, request_id)

    def admit(self, request: Request, request_id: int | None = None) -> int:
        """Queue `request`, which `validate` passed, under `request_id` (a fresh id when None)."""
        seq_id = next(self._ids) if request_id is None else request_id
        if seq_id in self.sequences:
            raise ValueError(f"request id {seq_id} is already in flight")
        eos = frozenset() if request.ignore_eos else (
            self.eos_ids if request.end_ids is None else frozenset(request.end_ids))
        if request.lora_task_id is not None:
            request = self._acquire_adapter(request)
        seq = Sequence.from_request(seq_id, request, eos)
        if request.guided_decoding is not None:
            seq.grammar = GrammarState(self.grammars.new_matcher(request.guided_decoding),
                                       self.eos_ids, self.grammars.tokenizer.vocab_size)
        if request.lora_task_id is not None:
            seq.lora_task_id = request.lora_task_id
            seq.lora_salt = self.lora.host[request.lora_task_id].fingerprint
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def _acquire_adapter(self, request: Request) -> Request:
        """Hold the request's adapter (loading the weights it carries); the request goes on
        without them. Raises ValueError naming the task id."""
        if self.lora is None:
            raise ValueError(f"lora_task_id {request.lora_task_id}: this engine serves no LoRA "
                             f"adapters (built without a lora section)")
        self.lora.acquire(request.lora_task_id, request.lora_weights, request.lora_config)
        return dataclasses.replace(request, lora_weights=None, lora_config=None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq_id: int, error: str | None = None,
              counter: str | None = None) -> Response | None:
        """End a request now (cancelled, or failed with `error`): its blocks are freed; returns
        its final response, or None when the request is not in flight. `counter`: the stat it
        counts in (default: failed or cancelled requests)."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq, FinishReason.ERROR if error else FinishReason.CANCELLED)
        self._release(seq)
        self.stats[counter or ("num_failed_requests" if error else "num_cancelled_requests")] += 1
        response = self._response(seq, final=True)
        response.error = error
        return response

    def expire(self) -> list[Response]:
        """End every request past its deadline (waiting or running) with an error naming its
        timeout field; their blocks are freed. Returns their final responses."""
        now = self.clock()
        expired = []
        for seq_id, seq in list(self.sequences.items()):
            timeout_ms = seq.request.timeout_ms
            if timeout_ms is None or seq.arrival_ns is None:
                continue
            if now - seq.arrival_ns >= timeout_ms * 1_000_000:
                message = deadline_error(seq, now)
                expired.append(self.abort(seq_id, error=message,
                                          counter="num_timed_out_requests"))
        return expired

    def step(self, return_logits: bool = False,
             while_running: Callable[[], None] | None = None) -> list[Response]:
        """One step; `while_running`: host work that does not touch the running batch (the
        executor's admission of new requests), done while a GPU computes the step."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        try:
            self.faults.check("step")
            eos = {c.seq_id: self.sequences[c.seq_id].eos_ids
                   for c in output.chunks if c.needs_sample}
            started = time.perf_counter()
            result = self.runner.run(output, eos, return_logits=return_logits,
                                     while_running=while_running)
            self._observe_step_time(output, time.perf_counter() - started)
            finished = self.scheduler.update(output, result.sampled, result.accepted, result.top)
        except SamplingError as exc:
            return self._fail_step(exc.failures)
        except Exception as exc:  # the batch fails, the engine goes on
            log.exception("engine step failed; ending the %d requests of its batch",
                          len(output.chunks))
            message = f"the engine step failed: {type(exc).__name__}: {exc}"
            return self._fail_step({c.seq_id: message for c in output.chunks})
        self._count(output, result.accepted)
        self.last_logits = result.logits
        responses = self._responses(output, finished)
        if self.speculator is not None:  # drafts for the next step, from the tokens just added
            self.speculator.propose(self.scheduler.running)
        return responses

    def _observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Every step teaches the scheduler what rows and attention cost: decode steps the fixed
        part, prefill steps (hundreds of rows) the per-row part, chunks deep in long prompts the
        per-key part."""
        self.scheduler.step_cost.observe(output.num_tokens, seconds, output.num_keys)

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq.seq_id)
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)
        if seq.lora_task_id is not None:
            self.lora.release(seq.lora_task_id)

    def _fail_step(self, failures: dict[int, str]) -> list[Response]:
        self.stats["num_failed_steps"] += 1
        responses = [self.abort(seq_id, error=message) for seq_id, message in failures.items()]
        return [r for r in responses if r is not None]

    def reset(self, error: str) -> list[Response]:
        """End every request in flight with `error` and start again from an empty batch and a
        free KV pool (the prefix cache emptied too): after a crash outside a step, the
        scheduler's state cannot be trusted. The model and its KV storage stay."""
        failed = [Response(seq_id, [], True, FinishReason.ERROR, error=error)
                  for seq_id in self.sequences]
        self.stats["num_failed_requests"] += len(failed)
        for seq_id in list(self.sequences):
            if self.speculator is not None:
                self.speculator.release(seq_id)
        self.sequences.clear()
        if self.lora is not None:
            self.lora.release_all()
        old = self.block_manager
        self.block_manager = BlockManager(old.num_blocks, old.tokens_per_block,
                                          enable_prefix_caching=old.enable_prefix_caching,
                                          cache_salt=cache_salt(self.config))
        self.scheduler = self._new_scheduler()
        self.runner.reset_sampling()
        return failed

    def _count(self, output: SchedulerOutput, accepted: dict[int, list]) -> None:
        for chunk in output.chunks:
            if chunk.num_draft_tokens:
                self.stats["spec_num_verify_steps"] += 1
                self.stats["spec_num_draft_tokens"] += chunk.num_draft_tokens
                self.stats["spec_num_accepted_tokens"] += len(accepted.get(chunk.seq_id, ()))
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
                self._release(seq)
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
            top_ids=seq.top_ids[start:], top_log_probs=seq.top_log_probs[start:],
            # Both log-prob outputs follow return_log_probs, as TensorRT-LLM's do: a cumulative
            # figure beside per-token zeros read as if the tokens were certain.
            cum_log_prob=sum(seq.log_probs) if seq.request.return_log_probs else 0.0,
            num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(generated), num_reused_blocks=seq.num_reused_blocks,
            num_new_blocks=seq.num_new_blocks, num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_tokens,
            queue_time_ns=(max(0, seq.scheduled_ns - seq.arrival_ns)
                           if final and seq.scheduled_ns is not None else None))

    def get_stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return dict(self.stats, num_preemptions=sched.num_preemptions,
                    num_free_blocks=bm.num_free_blocks,
                    num_used_blocks=bm.num_used_blocks,
                    num_total_blocks=bm.num_blocks,
                    num_active_requests=len(sched.running),
                    num_waiting_requests=len(sched.waiting),
                    num_waiting_tokens=sched.waiting.load()[1],
                    tokens_per_block=bm.tokens_per_block,
                    **self.runner.ops.stats(),
                    **self.grammars.get_stats(),
                    **prefix_cache_stats(bm, sched), **self._spec_stats(), **self._lora_stats())

    def _lora_stats(self) -> dict:
        """Adapter cache counters, the most distinct adapters one step runs, and per adapter name
        how many requests run and wait."""
        if self.lora is None:
            return {}
        running, waiting = {}, {}
        for seq in self.scheduler.running:
            if seq.lora_task_id is not None:
                name = self.lora.name_of(seq.lora_task_id)
                running[name] = running.get(name, 0) + 1
        for seq in self.sequences.values():
            if seq.lora_task_id is not None and seq.status.value == "waiting":
                name = self.lora.name_of(seq.lora_task_id)
                waiting[name] = waiting.get(name, 0) + 1
        return dict(self.lora.get_stats(), lora_max_loras=self.lora.limits.max_loras,
                    lora_running=running, lora_waiting=waiting)

    def _spec_stats(self) -> dict:
        steps, drafts = self.stats["spec_num_verify_steps"], self.stats["spec_num_draft_tokens"]
        accepted = self.stats["spec_num_accepted_tokens"]
        return {"spec_enabled": int(self.speculator is not None),
                "spec_num_paused_steps": self.speculator.num_paused_steps if self.speculator else 0,
                "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
                # tokens a verify step yields: the accepted drafts plus the target's own
                "spec_mean_accepted_length": (accepted + steps) / steps if steps else 0.0}


def deadline_error(seq: Sequence, now_ns: int) -> str:
    """`timeout_ms: request exceeded its deadline of X ms (waited Y ms)`; a request that was
    admitted says how long it waited and how long it has run since."""
    request = seq.request
    head = (f"{request.timeout_field}: request exceeded its deadline of {request.timeout_ms} ms")
    if seq.scheduled_ns is None:
        return f"{head} (waited {_ms(now_ns - seq.arrival_ns)} ms)"
    return (f"{head} (waited {_ms(seq.scheduled_ns - seq.arrival_ns)} ms, ran "
            f"{_ms(now_ns - seq.scheduled_ns)} ms)")


def _ms(ns: int) -> int:
    return max(0, ns) // 1_000_000


def prefix_cache_stats(bm: BlockManager, sched: Scheduler) -> dict:
    queried, hits = sched.num_prefix_queried_tokens, sched.num_prefix_hit_tokens
    return {"prefix_cache_enabled": int(bm.enable_prefix_caching),
            "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
            "prefix_cache_hit_rate": hits / queried if queried else 0.0,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_reusable_blocks": bm.num_reusable_blocks,
            "num_evicted_blocks": bm.num_evictions}

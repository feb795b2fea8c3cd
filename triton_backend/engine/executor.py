"""The executor: the engine loop, with TensorRT-LLM executor verbs.

`enqueue_request`, `cancel_request`, `await_responses`, `get_stats` and `shutdown` are
thread-safe. Requests join the running batch at the next step; cancellations take effect between
steps (the sequence's blocks are freed before the next step runs). Every accepted request ends
with exactly one final response: output, an error, or a cancellation.

The loop runs on a background thread by default, or on the caller's thread with
`start_loop=False` + `run_loop()`: torch runs at full speed only when its ops come from the
thread that owns the process's OpenMP team, so the engine process (`process/main.py`) runs the
loop on its main thread and only moves messages on other threads.

Admission: with `AdmissionLimits`, a request that would make too much wait is refused at once
with `ServerBusy` (see `admission.py`); the count is exact, read under the lock that also moves
queued requests into the scheduler. Deadlines: before every step, requests past their
`timeout_ms` end with an error (`LLMEngine.expire`).

Failures: a step that raises ends only its own requests (see `LLMEngine.step`). An exception
outside a step ends the requests in flight with an error naming it, and the loop starts again in
place from an empty batch, up to the restart policy's limit; past it the loop stops and every
request, queued or later, is refused (`is_alive()` turns false).

Progress: the loop advances `progress` (the engine's count, see `progress.py`) on every iteration,
and an idle loop wakes every `LOOP_TICK_SECONDS` to advance it, so a watchdog can tell an idle
engine from a frozen one. `get_stats` never waits for the loop's lock (which the loop holds while
it admits requests, an adapter load included): the engine process reports its heartbeats from it.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from triton_backend.engine.admission import AdmissionLimits
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.progress import LOOP_TICK_SECONDS
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.response_queue import LoopMailbox, ResponseQueue
from triton_backend.engine.scheduler import DEFAULT_AGING_RATE
from triton_backend.engine.supervision import CrashLoop, RestartPolicy

log = logging.getLogger(__name__)


class Executor(LoopMailbox):
    def __init__(self, engine_dir: str | Path, *, kv_cache_num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, device: str | None = None,
                 start_loop: bool = True, enable_prefix_caching: bool | None = None,
                 enable_speculative_decoding: bool | None = None,
                 restart_policy: RestartPolicy = RestartPolicy(),
                 admission: AdmissionLimits = AdmissionLimits(),
                 priority_aging_rate: float = DEFAULT_AGING_RATE,
                 kv_cache_free_gpu_mem_fraction: float | None = None,
                 enable_cuda_graphs: bool | None = None) -> None:
        self.engine = LLMEngine(engine_dir, kv_cache_num_blocks=kv_cache_num_blocks,
                                kv_cache_memory_bytes=kv_cache_memory_bytes, device=device,
                                enable_prefix_caching=enable_prefix_caching,
                                enable_speculative_decoding=enable_speculative_decoding,
                                priority_aging_rate=priority_aging_rate,
                                kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
                                enable_cuda_graphs=enable_cuda_graphs)
        self.admission = admission
        self._crashes = CrashLoop(restart_policy)
        self.config = self.engine.config
        self.tokenizer_dir = self.engine.tokenizer_dir
        self.progress = self.engine.progress
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._mailbox = ResponseQueue()
        self._pending: list[Request] = []
        self._pending_ids: list[int] = []
        self._cancels: set[int] = set()
        self._next_id = 1
        self._shutdown = False
        self._down_reason = ""
        self._loop_alive = True  # until the loop has ended (or, with start_loop=False, started)
        self._loop_done = threading.Event()
        self._stats = self.engine.get_stats()
        self._refused: list[Response] = []  # refused while a step ran: published after it
        # On a GPU the loop admits new requests while a step computes (see LLMEngine.step).
        self._overlap = (self._admit_while_running if self.engine.device.type == "cuda"
                         else None)
        if start_loop:
            threading.Thread(target=self.run_loop, name="llm-forge-executor", daemon=True).start()

    # -- client verbs -------------------------------------------------------------------------
    def enqueue_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and queue `request`; returns its id. Raises ValueError naming the bad field,
        ServerBusy (a RuntimeError) when the admission limits are reached.

        `request_id` lets a caller that numbers requests itself (the engine process client)
        choose the id; it must not be in use. Checked here once: the loop admits it as it is."""
        self.engine.validate(request)
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"executor is shut down{self._down_reason}")
            num_waiting, num_tokens = self.engine.scheduler.waiting.load()
            self.admission.check(num_waiting + len(self._pending),
                                 num_tokens + sum(len(r.input_token_ids) for r in self._pending),
                                 len(request.input_token_ids))
            if request_id is None:
                request_id = self._next_id
                self._next_id += 1
            self._pending.append(request)
            self._pending_ids.append(request_id)
            self._wakeup.notify()
        return request_id

    def cancel_request(self, request_id: int) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._wakeup.notify()

    def get_stats(self) -> dict:
        """Counters as of the end of the last step (the engine is only touched by the loop)."""
        with self._stats_lock:
            stats = self._stats
        return dict(stats, num_queued_requests=len(self._pending),
                    num_loop_restarts=self._crashes.num_crashes)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight end with a CANCELLED final response."""
        with self._lock:
            self._shutdown = True
            self._wakeup.notify()
        self._loop_done.wait(timeout)

    # -- loop ---------------------------------------------------------------------------------
    def _publish(self, responses: list[Response]) -> None:
        stats = self.engine.get_stats()
        with self._stats_lock:
            self._stats = stats
        self._mailbox.put(responses)

    def _admit(self) -> bool:
        """Move queued requests and cancellations into the engine. False when shutting down."""
        with self._lock:
            while not (self._pending or self._cancels or self._shutdown or self.engine.has_work()):
                self._wakeup.wait(LOOP_TICK_SECONDS)
                self.progress.tick()  # idle, not frozen
            finals = self._move_pending()
            cancels, self._cancels = self._cancels, set()
            shutting_down = self._shutdown
        finals += self._refused
        self._refused = []
        finals += [r for rid in cancels if (r := self.engine.abort(rid)) is not None]
        finals += self.engine.expire()
        self._publish(finals)
        self.engine.faults.check("loop")
        return not shutting_down

    def _move_pending(self) -> list[Response]:
        """Queued requests into the scheduler (call with the lock held, so the admission check
        never misses them); the final responses of those the engine refused."""
        finals = []
        for request_id, request in zip(self._pending_ids, self._pending):
            try:
                self.engine.admit(request, request_id=request_id)
            except ValueError as exc:  # this request only
                finals.append(Response(request_id, [], True, FinishReason.ERROR, error=str(exc)))
        self._pending.clear()
        self._pending_ids.clear()
        return finals

    def _admit_while_running(self) -> None:
        """While a GPU computes a step: requests that arrived join the waiting queue (they are
        scheduled from the next step on); cancels and deadlines wait for the step's end."""
        with self._lock:
            self._refused += self._move_pending()

    def run_loop(self) -> None:
        """Step the engine on the calling thread until `shutdown()`; then end what is left."""
        try:
            while True:
                try:
                    while self._admit():
                        self._publish(self.engine.step(while_running=self._overlap))
                        self.progress.tick()
                    break
                except Exception as exc:  # the loop must not die silently
                    log.exception("executor loop failed")
                    message = f"internal error in the engine loop: {type(exc).__name__}: {exc}"
                    if not self._crashes.allow_restart():
                        self._down_reason = (f" (the engine loop crashed: {message}; "
                                             f"{self._crashes.describe()})")
                        self._fail_all(message, FinishReason.ERROR)
                        return
                    log.warning("restarting the engine loop in place (%s)",
                                self._crashes.describe())
                    self._publish(self.engine.reset(message))
            self._fail_all("the executor was shut down", FinishReason.CANCELLED)
        finally:
            self._loop_alive = False
            self._loop_done.set()

    def _fail_all(self, message: str, reason: FinishReason) -> None:
        error = message if reason == FinishReason.ERROR else None
        finals = []
        for seq_id in list(self.engine.sequences):
            response = self.engine.abort(seq_id, error=error)
            if response is not None:
                response.finish_reason = reason
                finals.append(response)
        with self._lock:
            self._shutdown = True
            pending, self._pending, self._pending_ids = self._pending_ids, [], []
        finals += [Response(rid, [], True, reason, error=error) for rid in pending]
        self._publish(finals)

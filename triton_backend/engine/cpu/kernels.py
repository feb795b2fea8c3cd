"""The runtime's CPU kernels: a small C++ torch extension, built once per machine and cached.

`load_cpu_kernels()` compiles `csrc/*.cpp` with the system compiler (`-march=native`: it is built
on the machine that runs it) into the operator library `torch.ops.llm_forge`, under
`<cache>/kernels/<key>/`, where the key hashes the sources, the flags, the torch version and
install (two virtual environments write different include paths into the build files, so sharing
a build directory would make them rebuild in turn), for `-march=native` the CPU, and the ninja that builds it. The first call on a machine compiles (tens of seconds, logged with its time); later calls,
in any process, load the cached library in well under a second. Processes that start at once
(a server's model instances, a build beside a `forge generate`) compile once: the build runs
under a file lock, and a process that finds it held says so, waits, then loads what the first
one built.

The ninja is the one beside the running interpreter (its environment's `ninja` wheel) before
any on PATH: ninja 1.11 and 1.13 hash commands differently in their build logs, so each took the
other's objects for stale, and a cache loaded by processes with and without the environment's
`bin/` on PATH was recompiled by each in turn.

A named instruction-set level (`LLM_FORGE_KERNEL_MARCH=x86-64-v3`) makes one library for every CPU
that has the level, so an image can carry it compiled at build time: its key leaves the CPU out,
a CPU without the level gets the pure-torch paths (never an illegal instruction), and what is
measured per CPU (the GEMM plans) is keyed by `plan_key()`, which always names the CPU.

Everything here has a pure-torch equivalent in the model code, used when the extension cannot be
built (no compiler, no ninja) or when `LLM_FORGE_KERNELS=torch` asks for it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engine.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCES = ("register.cpp", "gemm.cpp", "gemm_bf16_dot.cpp", "gemm_int4_dot.cpp", "layer_ops.cpp",
           "attention.cpp", "prefill_attention.cpp", "forward.cpp", "lora.cpp", "sampling.cpp",
           "moe.cpp", "gemm_bf16_amx.cpp")
HEADERS = ("vec.h", "ops.h", "step.h", "layer_rows.h", "prefill_tiles.h", "prefill_tiles_dot.h",
           "prefill_tiles_amx.h", "prefill_groups.h", "prefill_item.h")
CSRC = Path(__file__).resolve().parent / "csrc"
# No implicit FMA contraction: elementwise kernels round like the torch ops they replace; the
# GEMM and dot products fuse explicitly.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17")
# The instruction set the kernels are built for: this CPU's own (native), or a lower x86-64 level
# to build and test the code paths another CPU takes (x86-64-v3: AVX2 and FMA, no AVX-512).
MARCH_ENV = "LLM_FORGE_KERNEL_MARCH"
MARCH_CHOICES = ("native", "x86-64-v2", "x86-64-v3", "x86-64-v4")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)
# "torch": never build, use the pure-torch paths; "gpu": the GPU backend's step on any device.
ENV_SWITCH = "LLM_FORGE_KERNELS"

# The CPU flags each named level needs (the x86-64 psABI levels, as gcc's -march takes them); a
# library built for a level runs only where /proc/cpuinfo lists every one.
MARCH_FLAGS = {
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1",
                  "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1",
                  "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "avx512f", "avx512bw",
                  "avx512cd", "avx512dq", "avx512vl"),
}

_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        fields = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(fields)))
    except OSError:
        return platform.processor() or platform.machine()


def march() -> str:
    """The instruction-set level asked for by `LLM_FORGE_KERNEL_MARCH` (default native)."""
    chosen = os.environ.get(MARCH_ENV, "native").strip() or "native"
    if chosen not in MARCH_CHOICES:
        raise ValueError(f"{MARCH_ENV} must be one of {', '.join(MARCH_CHOICES)}, got {chosen!r}")
    return chosen


def ninja_path() -> str | None:
    """The ninja the kernels are built with: the running environment's own, else PATH's."""
    local = Path(sys.executable).parent / "ninja"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("ninja")


def _ninja_version(ninja: str | None) -> str:
    if ninja is None:
        return "no ninja"
    try:
        return subprocess.run([ninja, "--version"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no ninja"


def cflags() -> tuple[str, ...]:
    return (*CFLAGS, f"-march={march()}")


def missing_cpu_flags(level: str, cpu_flags: set[str]) -> list[str]:
    """The flags of a named level that this CPU lacks (none for native: built for itself)."""
    return [flag for flag in MARCH_FLAGS.get(level, ()) if flag not in cpu_flags]


def _cpu_flags() -> set[str]:
    for line in _cpu_signature().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def build_key() -> str:
    """Names one build of the kernels: sources, flags, torch (version and install), the ninja
    version (two ninjas in one build directory rebuild each other's objects) and, for native
    builds only, the CPU (a named level's library is the same on every CPU)."""
    if "key" in _state:
        return str(_state["key"])
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((*cflags(), *LDFLAGS)).encode())
    digest.update(torch.__version__.encode())
    digest.update(os.path.dirname(torch.__file__).encode())
    if march() == "native":
        digest.update(_cpu_signature().encode())
    digest.update(_ninja_version(ninja_path()).encode())
    _state["key"] = digest.hexdigest()[:16]
    return str(_state["key"])


def plan_key() -> str:
    """Names what is measured on one CPU with one build (the GEMM plans): the build key, which
    for native builds already names the CPU, else the build key and the CPU."""
    key = build_key()
    if march() == "native":
        return key
    cpu = hashlib.sha256(_cpu_signature().encode()).hexdigest()[:8]
    return f"{key}-cpu-{cpu}"


def kernels_wanted() -> bool:
    choice = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if choice not in ("auto", "cpp", "torch", "gpu"):
        raise ValueError(f"{ENV_SWITCH} must be auto, cpp, torch or gpu, got {choice!r}")
    return choice != "torch"


def load_cpu_kernels(report: Callable[[str], None] | None = None) -> bool:
    """Make `torch.ops.llm_forge` available; False (with the reason logged) when it cannot be.

    `report` receives one human line (built in N s / loaded from cache / unavailable: why).
    The switch is read at every call (a calibration run turns the kernels off for a while and
    back on); what a load found is kept for the process."""
    say = report or log.info
    if not kernels_wanted():
        say(f"CPU kernels: off ({ENV_SWITCH}=torch), using the pure-torch paths")
        return False
    if "ok" in _state:
        return bool(_state["ok"])
    if platform.machine() == "x86_64":
        missing = missing_cpu_flags(march(), _cpu_flags())
        if missing:
            _state["ok"] = False
            say(f"CPU kernels: built for {march()} ({MARCH_ENV}), which this CPU lacks "
                f"({', '.join(missing)}); using the pure-torch paths")
            return False
    key = build_key()
    build_dir = cache_root() / "kernels" / key
    built = build_dir / f"llm_forge_cpu_{key}.so"
    if built.is_file() and not _writable(build_dir):
        return _load_read_only(built, say)
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    waited = 0.0
    try:
        with _build_lock(build_dir, say) as wait_seconds:
            waited = wait_seconds
            # Looked at under the lock: a library another process just built is a cached one.
            cached = any(build_dir.glob("*.so"))
            _compile(build_dir, key)
    except Exception as exc:  # no compiler, no ninja, a toolchain too old: keep serving
        _state["ok"] = False
        say(f"CPU kernels: unavailable ({type(exc).__name__}: {str(exc)[:300]}); "
            f"using the pure-torch paths")
        return False
    elapsed = time.perf_counter() - start
    _state["ok"] = True
    after_wait = f", after {waited:.1f}s waiting for another process's build" if waited else ""
    if cached:
        say(f"CPU kernels: loaded from the cache ({elapsed - waited:.1f}s{after_wait})")
    else:
        target = "this CPU" if march() == "native" else march()
        say(f"CPU kernels: compiled for {target} in {elapsed - waited:.1f}s, cached in "
            f"{build_dir}{after_wait}")
    return True


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _load_read_only(library: Path, say: Callable[[str], None]) -> bool:
    """A cache nobody may write (an image's, under a read-only root filesystem): its library
    was built for this key, and neither the lock nor ninja (which opens its logs for writing
    even with nothing to do) can run there, so the library is loaded as it is."""
    start = time.perf_counter()
    try:
        torch.ops.load_library(str(library))
    except Exception as exc:
        _state["ok"] = False
        say(f"CPU kernels: unavailable ({type(exc).__name__}: {str(exc)[:300]}); "
            f"using the pure-torch paths")
        return False
    _state["ok"] = True
    say(f"CPU kernels: loaded from a read-only cache ({time.perf_counter() - start:.1f}s)")
    return True


def _compile(build_dir: Path, key: str) -> None:
    """Compile (or, when ninja finds nothing changed, only load) the library of `build_dir`.
    Called under the build lock; tests replace it with a cheap fake build."""
    from torch.utils.cpp_extension import load

    with _ninja_first_on_path():
        load(name=f"llm_forge_cpu_{key}", sources=_stage_sources(build_dir),
             extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
             build_directory=str(build_dir), is_python_module=False, verbose=False)


@contextlib.contextmanager
def _ninja_first_on_path():
    """torch runs the `ninja` it finds on PATH: make that the one the build key names."""
    ninja, previous = ninja_path(), os.environ.get("PATH", "")
    if ninja is not None:
        os.environ["PATH"] = os.pathsep.join((str(Path(ninja).parent), previous))
    try:
        yield
    finally:
        os.environ["PATH"] = previous


@contextlib.contextmanager
def _build_lock(build_dir: Path, say: Callable[[str], None]):
    """One build per cache directory at a time, under a lock the OS releases when its holder
    dies; yields the seconds spent waiting for another holder (0.0 when it was free), after
    saying that it waits, so a second process does not look hung. torch's own build lock is a
    file that a process killed mid-build (Ctrl-C, kill -9) leaves behind, and every later load
    would wait on it forever: holding ours, any such file is stale and removed."""
    with open(build_dir / ".llm-forge-build.lock", "w") as handle:
        waited = 0.0
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("CPU kernels: another process is building them for this CPU and source; "
                "waiting for it (a first build takes tens of seconds)")
            start = time.perf_counter()
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = time.perf_counter() - start
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stage_sources(build_dir: Path) -> list[str]:
    """The sources copied into the cache directory (the key already names their content), so
    every checkout compiles the same paths and ninja does not rebuild when another checkout of
    the same code loads the kernels."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for name in (*SOURCES, *HEADERS):
        source, target = CSRC / name, staged / name
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target)
    return [str(staged / s) for s in SOURCES]


def loaded() -> bool:
    """True once `load_cpu_kernels()` succeeded in this process (never builds or loads)."""
    return bool(_state.get("ok"))


def ops():
    """`torch.ops.llm_forge` (call `load_cpu_kernels()` first)."""
    return torch.ops.llm_forge

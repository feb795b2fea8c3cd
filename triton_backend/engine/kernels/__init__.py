"""The runtime's CPU kernels: a small C++ torch extension, built once per machine and cached.

`load_cpu_kernels()` compiles `csrc/*.cpp` with the system compiler (`-march=native`: it is built
on the machine that runs it) into the operator library `torch.ops.llm_forge`, under
`<cache>/kernels/<key>/`, where the key hashes the sources, the flags, the torch version and
install (two virtual environments write different include paths into the build files, so sharing
a build directory would make them rebuild in turn) and, for `-march=native`, the CPU. The first call on a machine compiles (tens of seconds, logged with its time); later calls,
in any process, load the cached library in well under a second.

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
import time
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engine.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCES = ("register.cpp", "gemm.cpp", "gemm_bf16_dot.cpp", "gemm_int4_dot.cpp", "layer_ops.cpp",
           "attention.cpp", "forward.cpp", "lora.cpp", "sampling.cpp")
HEADERS = ("vec.h", "ops.h", "step.h", "layer_rows.h")
CSRC = Path(__file__).resolve().parent / "csrc"
# No implicit FMA contraction: elementwise kernels round like the torch ops they replace; the
# GEMM and dot products fuse explicitly.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17")
# The instruction set the kernels are built for: this CPU's own (native), or a lower x86-64 level
# to build and test the code paths another CPU takes (x86-64-v3: AVX2 and FMA, no AVX-512).
MARCH_ENV = "LLM_FORGE_KERNEL_MARCH"
MARCH_CHOICES = ("native", "x86-64-v2", "x86-64-v3", "x86-64-v4")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)
ENV_SWITCH = "LLM_FORGE_KERNELS"  # "torch": never build, use the pure-torch paths

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
    """Names one build of the kernels: sources, flags, torch (version and install) and, for
    native builds only, the CPU (a named level's library is the same on every CPU)."""
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
    if choice not in ("auto", "cpp", "torch"):
        raise ValueError(f"{ENV_SWITCH} must be auto, cpp or torch, got {choice!r}")
    return choice != "torch"


def load_cpu_kernels(report: Callable[[str], None] | None = None) -> bool:
    """Make `torch.ops.llm_forge` available; False (with the reason logged) when it cannot be.

    `report` receives one human line (built in N s / loaded from cache / unavailable: why)."""
    if "ok" in _state:
        return bool(_state["ok"])
    say = report or log.info
    if not kernels_wanted():
        _state["ok"] = False
        say(f"CPU kernels: off ({ENV_SWITCH}=torch), using the pure-torch paths")
        return False
    if platform.machine() == "x86_64":
        missing = missing_cpu_flags(march(), _cpu_flags())
        if missing:
            _state["ok"] = False
            say(f"CPU kernels: built for {march()} ({MARCH_ENV}), which this CPU lacks "
                f"({', '.join(missing)}); using the pure-torch paths")
            return False
    key = build_key()
    build_dir = cache_root() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob("*.so"))
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        with _build_lock(build_dir):
            load(name=f"llm_forge_cpu_{key}", sources=_stage_sources(build_dir),
                 extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a toolchain too old: keep serving
        _state["ok"] = False
        say(f"CPU kernels: unavailable ({type(exc).__name__}: {str(exc)[:300]}); "
            f"using the pure-torch paths")
        return False
    elapsed = time.perf_counter() - start
    _state["ok"] = True
    if cached:
        say(f"CPU kernels: loaded from the cache ({elapsed:.1f}s)")
    else:
        target = "this CPU" if march() == "native" else march()
        say(f"CPU kernels: compiled for {target} in {elapsed:.1f}s, cached in {build_dir}")
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One build per cache directory at a time, under a lock the OS releases when its holder
    dies. torch's own build lock is a file that a process killed mid-build (Ctrl-C, kill -9)
    leaves behind, and every later load would wait on it forever: holding ours, any such file
    is stale and removed."""
    with open(build_dir / ".llm-forge-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
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

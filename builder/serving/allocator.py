"""The memory allocator tritonserver and its Python stubs run with (`forge serve --malloc`).

NVIDIA recommends jemalloc or tcmalloc for long-running servers: glibc's malloc keeps what a
peak of requests in flight allocated, so RSS steps up at each new peak; jemalloc and tcmalloc
give it back. The allocator is preloaded (`LD_PRELOAD`); the Debian/Ubuntu package is named
when one asked for is missing.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

ALLOCATOR_LIBRARIES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
}
ALLOCATOR_PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
MALLOC_CHOICES = ("auto", *ALLOCATOR_LIBRARIES, "system")


def library_dirs() -> list[Path]:
    """Where the system's shared libraries live."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    return [Path(d) for d in (f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64",
                              "/usr/lib", "/usr/local/lib")]


def find_allocator(malloc: str = "auto",
                   search_dirs: list[Path] | None = None) -> tuple[str, Path | None]:
    """(name, library) of the allocator to preload for `--malloc`: `auto` takes jemalloc, else
    tcmalloc, else the system's malloc; naming one that is not installed is an error."""
    if malloc not in MALLOC_CHOICES:
        raise ValueError(f"--malloc {malloc!r}: expected one of {', '.join(MALLOC_CHOICES)}")
    if malloc == "system":
        return "system", None
    dirs = library_dirs() if search_dirs is None else search_dirs
    for name in ALLOCATOR_LIBRARIES if malloc == "auto" else (malloc,):
        for filename in ALLOCATOR_LIBRARIES[name]:
            for directory in dirs:
                if (directory / filename).is_file():
                    return name, directory / filename
    if malloc == "auto":
        return "system", None
    raise FileNotFoundError(f"--malloc {malloc}: {' or '.join(ALLOCATOR_LIBRARIES[malloc])} "
                            f"not found in {', '.join(map(str, dirs))} (Debian/Ubuntu: apt-get "
                            f"install {ALLOCATOR_PACKAGES[malloc]})")


def with_allocator(env: dict[str, str], malloc: str = "auto",
                   search_dirs: list[Path] | None = None) -> tuple[dict[str, str], str]:
    """`env` with the allocator preloaded (an allocator the caller already preloads is kept)
    and its name."""
    preloaded = env.get("LD_PRELOAD", "")
    for name in ALLOCATOR_LIBRARIES:
        if any(Path(item).name.startswith(f"lib{name}")
               for item in preloaded.replace(":", " ").split()):
            return env, name
    name, library = find_allocator(malloc, search_dirs)
    if library is not None:
        env = dict(env, LD_PRELOAD=":".join(filter(None, [str(library), preloaded])))
    return env, name

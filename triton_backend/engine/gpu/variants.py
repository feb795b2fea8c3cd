"""The Triton kernel variants the GPU backend launches, and the compiles while serving.

Triton compiles a kernel once per process for each set of compile-time constants (and argument
dtypes): a variant. A cold process pays every variant it meets, a few hundred milliseconds to
seconds each on a GPU; the engine pays them at start-up (`gpu/warmup.py`) so that no request
does. `note` is called at every launch decision with the variant's key, on every device (off
CUDA the kernels' references run, but the variants they stand for are the same), so the count
of variants a run needs is known on a CPU too. A variant first seen after `mark_warm` is a
compile while serving: logged as a warning and counted (`compiles_after_warmup`, in the
engine's stats).

Where Triton really compiles (CUDA), its post-compile hook counts the compiles themselves
(`num_compiles`), and those after the warm-up are what is warned about and counted (a variant
may compile more than once there: Triton also specializes on its integer arguments' values).
The record is per process, as Triton's compile cache is.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger(__name__)


class KernelVariants:
    def __init__(self) -> None:
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        self.warm = False
        self._warming = 0
        self.compiles_after_warmup = 0
        self.num_compiles = 0
        self._hooked = False

    @property
    def num_variants(self) -> int:
        return len(self._seen)

    def note(self, kernel: str, *key) -> None:
        """Record one launch decision of `kernel` with the compile-time `key`."""
        variant = (kernel, *key)
        if variant in self._seen:
            return
        with self._lock:
            if variant in self._seen:
                return
            self._seen.add(variant)
            late = self.warm and not self._warming and not self._hooked
            if late:  # where Triton compiles, its hook counts the compiles themselves
                self.compiles_after_warmup += 1
        if late:
            log.warning("Triton kernel %s compiles a new variant %s after the start-up "
                        "warm-up (%d so far): a request waits for it", kernel, key,
                        self.compiles_after_warmup)

    @contextmanager
    def warming(self) -> Iterator[None]:
        """Start-up work: what it launches is warm-up, however warm the process already is (a
        second engine in one process warms its own shapes)."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1

    def mark_warm(self) -> None:
        """From now on a new variant is a compile while serving."""
        self.warm = True

    def hook_compiles(self) -> None:
        """Count Triton's own compiles (CUDA), chained after any hook already set."""
        if self._hooked:
            return
        from triton_backend.engine.gpu.triton_support import triton

        if triton is None or not hasattr(triton, "knobs"):
            return
        runtime = triton.knobs.runtime
        previous = runtime.jit_post_compile_hook

        def counted(*args, **kwargs):
            with self._lock:
                self.num_compiles += 1
                late = self.warm and not self._warming
                if late:
                    self.compiles_after_warmup += 1
            if late:
                log.warning("Triton compiles %s after the start-up warm-up (%d so far): a "
                            "request waits for it", kwargs.get("repr") or kwargs.get("key"),
                            self.compiles_after_warmup)
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = counted
        self._hooked = True


VARIANTS = KernelVariants()

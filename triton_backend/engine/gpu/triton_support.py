"""Triton, where it is installed (CUDA hosts; the interpreter in tests): `triton` and `tl`, or
None for both. The GPU backend's kernels are defined only when it imports."""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU host: the backend runs its torch references
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Under Triton's interpreter (tests on a CPU), whose dot products of 16-bit floats are
    wrong: the kernels then multiply in float32."""
    return os.environ.get("TRITON_INTERPRET") == "1"

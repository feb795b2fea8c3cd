"""The paged kernel's 16-bit `tl.dot` branches run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a process of its own), its bf16 dots emulated as a tensor core computes
them, against the torch reference (`gpu_kernel_checks._case`). Prints one line per case; exits 1
on the first mismatch."""
from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter"

from gpu_kernel_checks import _case  # noqa: E402

BF16_DOT_CASES = [
    ("bf16 dot decode gqa4", dict(num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
                                  chunks=[(20, 1), (47, 1), (0, 1)], dtype=torch.bfloat16)),
    ("bf16 dot prefill + prefix gqa3 d64", dict(num_heads=9, num_kv_heads=3, head_dim=64,
                                                tokens_per_block=16,
                                                chunks=[(0, 13), (16, 7), (3, 40)],
                                                dtype=torch.bfloat16)),
    ("bf16 dot splits", dict(num_heads=4, num_kv_heads=1, head_dim=16, tokens_per_block=8,
                             chunks=[(100, 1), (3, 1), (60, 1)], dtype=torch.bfloat16,
                             num_splits=4)),
    ("bf16 dot fp8 kv", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                             chunks=[(11, 1), (4, 6)], dtype=torch.bfloat16, kv="fp8")),
]


def _emulate_tensor_core_bf16_dots() -> None:
    """Run the kernels' 16-bit `tl.dot` branches here. The interpreter keeps bfloat16 as raw
    uint16 and multiplies those integers; a tensor core multiplies the bf16 values exactly (a
    bf16 product fits a float32) and accumulates in float32, which this does: widen the bits,
    then a float32 matmul. And lift the kernels' interpreter switch to float32 dots."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from triton_backend.engine.gpu import paged_attention as module

    original = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar == tl.bfloat16 or getattr(handle.dtype, "element_ty", None) == \
                tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    module.interpreted = lambda: False


def main() -> int:
    _emulate_tensor_core_bf16_dots()
    from triton_backend.engine.gpu.paged_attention import launch_constants

    assert not launch_constants(torch.bfloat16, False, 4, 2, 16, 8, 1, 1)["IEEE"]
    for seed, (name, kwargs) in enumerate(BF16_DOT_CASES):
        diff = _case(seed, **kwargs)
        # bf16 inputs, float32 scores, p rounded to bf16 before P @ V as on the GPU: as close
        # to the float32 reference as the float32-dot bf16 case above (|out| < 4 here).
        print(f"{name}: max |kernel - reference| {diff:.2e} (tolerance 2e-02)")
        if not diff <= 2e-2:
            return 1
    return 0



if __name__ == "__main__":
    sys.exit(main())

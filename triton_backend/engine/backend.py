"""Which ops backend a device gets, decided once when a model runner loads: the GPU backend
(`gpu/ops.py`) on CUDA where Triton imports, the C++ kernels (`cpu/ops.py`) on a CPU where they
build, the torch reference (`ops.TorchOps`) everywhere else."""
from __future__ import annotations

import logging
import os

import torch

from triton_backend.engine.ops import TorchOps

log = logging.getLogger(__name__)


def select_ops(device: torch.device) -> TorchOps:
    """The GPU backend on CUDA (where Triton imports), the C++ backend on a CPU when its kernels
    load, else the torch reference. `LLM_FORGE_KERNELS=gpu` runs the GPU backend's step on any
    device (its kernels' torch references off CUDA: tests and `forge gpu-check --device cpu`)."""
    from triton_backend.engine.cpu.kernels import ENV_SWITCH, load_cpu_kernels
    from triton_backend.engine.cpu.ops import CppOps

    if device.type == "cuda" or os.environ.get(ENV_SWITCH, "").strip().lower() == "gpu":
        from triton_backend.engine.gpu.ops import GpuOps
        from triton_backend.engine.gpu.triton_support import available

        if device.type != "cuda" or available():
            return GpuOps(device)
        log.warning("no Triton on this CUDA host: the engine runs the pure-torch reference ops")
    if device.type == "cpu" and load_cpu_kernels():
        return CppOps()
    return TorchOps()

"""Which device an engine runs on: its hardware says where it belongs, a caller may say where.

An engine built for `hardware: cpu` runs on the CPU unless told otherwise; one built for a GPU
profile (l4, a100-*, h100-*, cuda) runs on the current CUDA device, or on the one named
(`cuda:N`, Triton's instance device). Asking for a GPU where none is visible is an error naming
that, raised before any weight is loaded.
"""
from __future__ import annotations

import torch

AUTO = "auto"


def resolve_device(hardware: str, requested: str | None = None) -> torch.device:
    """`requested` None / "auto": the engine's own kind of device; else that device."""
    name = "cpu" if requested in (None, AUTO) and hardware == "cpu" else (
        "cuda" if requested in (None, AUTO) else requested)
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {requested!r}") from None
    if device.type == "cuda":
        check_cuda_visible(device, hardware)
    elif device.type != "cpu":
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {requested!r}")
    return device


def check_cuda_visible(device: torch.device, hardware: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError(f"device {device}: the engine (hardware {hardware}) runs on a CUDA GPU "
                         f"and none is visible (torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda or 'not built in'})")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) are "
                         f"visible")


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. To a CUDA device it goes through pinned
    memory with a non-blocking copy, queued behind the work already launched instead of waiting
    for it (torch keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

"""Which device a `tensorrt_llm` model instance runs its engine on, from what Triton tells the
instance (its kind, device id and name) and the model's `gpu_device_ids` parameter.

- KIND_GPU: the GPU Triton gave the instance (`model_instance_device_id`), as NVIDIA's
  container runs GPU models: Triton makes `count` instances on every GPU it sees.
- KIND_MODEL: the model places itself. `gpu_device_ids` is NVIDIA's parameter: one set of device
  ids per instance, sets separated by `;`. The torch engine runs on one GPU, so each set is one
  id; a single set serves every instance; empty: the current CUDA device.
- KIND_CPU: None, the engine's own kind of device (a CPU engine on the CPU).

Pure: no Triton, no torch. Whether the device is there is the engine's check (engine/device.py).
"""
from __future__ import annotations

import re

PARAMETER = "gpu_device_ids"


def parse_gpu_device_ids(text: str) -> list[int]:
    """`"0"` -> [0], `"0;1"` -> [0, 1] (one per instance), `""` -> []."""
    text = str(text).strip()
    if not text:
        return []
    ids = []
    for part in text.split(";"):
        part = part.strip()
        if "," in part:
            raise ValueError(f"{PARAMETER} {text!r}: the torch engine runs on one GPU per "
                             f"instance; give one id per instance, separated by ';' (got {part!r})")
        if not part.isdigit():
            raise ValueError(f"{PARAMETER} {text!r}: expected CUDA device ids (integers >= 0) "
                             f"separated by ';', got {part!r}")
        ids.append(int(part))
    return ids


def check_instance_count(ids: list[int], count: int) -> None:
    """One id serves every instance; several must be one per instance (NVIDIA's rule)."""
    if len(ids) > 1 and len(ids) != count:
        raise ValueError(f"{PARAMETER}: {len(ids)} device ids for {count} instance(s); give one "
                         f"id for all, or one per instance")


def instance_index(instance_name: str) -> int:
    """The instance's index in its group: Triton names instances `<group>_<index>` (a group
    without a name is `<model>_<group index>`), e.g. `tensorrt_llm_0_1`."""
    match = re.search(r"_(\d+)$", instance_name)
    if match is None:
        raise ValueError(f"model instance name {instance_name!r}: expected '<group>_<index>'")
    return int(match.group(1))


def instance_device(args: dict, gpu_device_ids: str = "") -> str | None:
    """The device for the instance Triton describes in `args` (the Python backend's
    `initialize` arguments): `cuda:N`, `cuda`, or None (the engine's own kind of device)."""
    kind = str(args.get("model_instance_kind", "CPU")).upper()
    if kind == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    if kind != "MODEL":
        return None
    ids = parse_gpu_device_ids(gpu_device_ids)
    if not ids:
        return "cuda"
    if len(ids) == 1:
        return f"cuda:{ids[0]}"
    name = str(args.get("model_instance_name", ""))
    index = instance_index(name)
    if index >= len(ids):
        raise ValueError(f"{PARAMETER} {gpu_device_ids!r} names {len(ids)} devices, one per "
                         f"instance; instance {name} is number {index + 1}")
    return f"cuda:{ids[index]}"

"""Loading an engine's weights into the runtime model."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig
from triton_backend.engine import families
from triton_backend.engine.model import CausalLM

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runtime_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The compute dtype. float16 on a CPU is ~100x slower than bfloat16 here, so it runs as bf16."""
    dtype = TORCH_DTYPES[config.dtype]
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16
    return dtype


def load_model(engine_dir: str | Path, config: EngineConfig, device: torch.device) -> CausalLM:
    """Build the model for `config` and load `model.safetensors` into it (every key must match)."""
    dtype = runtime_dtype(config, device)
    with torch.device("meta"):
        model = families.get(config.model.architecture).build(config)
    state = load_file(str(Path(engine_dir) / WEIGHTS_FILE), device=str(device))
    hook = getattr(model, "prepare_state_dict", None)
    if hook is not None:
        state = hook(state)
    # Activations' dtype for weights; quantization scales keep their float32 precision.
    state = {k: (t.to(dtype) if t.is_floating_point() and t.dtype.itemsize >= 2
                 and not k.endswith("scaling_factor") else t)
             for k, t in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{engine_dir}/{WEIGHTS_FILE} does not match the engine config: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    # Buffers (rotary tables) are not in the state dict: materialize them for real.
    model.rotary = type(model.rotary)(config.model, config.limits.max_seq_len, device)
    return model.eval()

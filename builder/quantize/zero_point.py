"""INT4 with a zero per group, by llm-forge: asymmetric round-to-nearest, no calibration, no
ModelOpt, no TensorRT-LLM checkpoint (the torch target only).

A checkpoint whose projections already sit on an asymmetric 4-bit grid (a GGUF Q4_1 export such as
the demo model, a GPTQ/AWQ-with-zeros export) is reproduced by it instead of re-rounded onto the
symmetric grid `int4_awq`/`int4_rtn` use, which costs such a model most of its quality.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from builder import convert
from builder.quantize.modelopt_run import check_exclusion_patterns, is_excluded
from builder.quantize.options import QuantizeOptions
from triton_backend.engine.config import WEIGHTS_FILE, QuantConfig
from triton_backend.engine.models.llama import PROJECTIONS
from triton_backend.engine.quant import int4

QUANT_ALGO = "W4A16_ZERO_POINT"


def _is_projection(module: str) -> bool:
    return module.startswith("transformer.layers.") and module.endswith(PROJECTIONS)


def quantize_state(state: dict[str, torch.Tensor], options: QuantizeOptions,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Runtime weights (fp32) -> the same with every projection not excluded as packed INT4,
    `weights_scaling_factor` and `zero`; the rest cast to `dtype`."""
    modules = {key.rpartition(".")[0] for key in state} | {"lm_head"}  # a tied head is a module
    check_exclusion_patterns(options.exclude_modules, modules)
    out = {}
    for key, tensor in state.items():
        module, _, suffix = key.rpartition(".")
        if suffix == "weight" and _is_projection(module) and not is_excluded(
                module, options.exclude_modules):
            int4.check_group_size(tensor.shape[1], options.group_size, module)
            q, scales, zeros = int4.quantize_rtn_zero_point(tensor, options.group_size)
            out[key] = int4.pack(q)
            out[f"{module}.weights_scaling_factor"] = scales
            out[f"{module}.zero"] = zeros
        else:
            out[key] = tensor.to(dtype)
    return out


def quantize_zero_point(hf_dir: Path, engine_dir: Path, options: QuantizeOptions,
                        dtype: torch.dtype, progress: Callable[[str], None]):
    """Write engine_dir/model.safetensors; the result for the engine config."""
    from builder.quantize.quantizer import QuantizationResult, linear_bytes

    start = time.perf_counter()
    shape = convert.model_shape_from_hf(convert.read_hf_config(hf_dir))
    state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), shape, torch.float32)
    progress(f"INT4 with zeros, group {options.group_size}, round-to-nearest (no calibration)")
    state = quantize_state(state, options, dtype)
    save_file(state, str(Path(engine_dir) / WEIGHTS_FILE), metadata={"format": "pt"})
    stored, bf16 = linear_bytes(state)
    seconds = time.perf_counter() - start
    progress(f"quantized in {seconds:.0f}s; quantized linears {stored / 2**20:.1f} MiB "
             f"({stored / bf16:.0%} of 16-bit)")
    return QuantizationResult(
        quantization=QuantConfig(weights=options.weights, kv_cache="none",
                                 group_size=options.group_size,
                                 exclude_modules=list(options.exclude_modules), zero_point=True),
        kv_cache_dtype="auto",
        extra={"tool": "llm-forge", "quant_algo": QUANT_ALGO, "kv_cache_quant_algo": None,
               "seconds": round(seconds, 1)},
        quantized_linear_bytes=stored, quantized_linear_bf16_bytes=bf16)

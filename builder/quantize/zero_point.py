"""INT4 with a zero per group, by llm-forge: asymmetric round-to-nearest, no TensorRT-LLM
checkpoint (the torch target only).

A checkpoint whose projections already sit on an asymmetric 4-bit grid (a GGUF Q4_1 export such as
the demo model, a GPTQ/AWQ-with-zeros export) is reproduced by it instead of re-rounded onto the
symmetric grid `int4_awq`/`int4_rtn` use, which costs such a model most of its quality.

The weights need no calibration. A one-byte KV cache (`kv_cache: int8 | fp8`) does: its per-layer
scales come from ModelOpt's K/V quantizers run over the calibration text on the checkpoint with
every quantized projection replaced by its INT4 dequantization, so the keys and values measured
are the ones the engine will write.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

from builder.pipeline import convert
from builder.quantize import calibration, modelopt_run
from builder.quantize.modelopt_run import check_exclusion_patterns, is_excluded
from builder.quantize.options import QuantizeOptions
from builder.quantize.result import QuantizationResult, linear_bytes
from builder.quantize.trtllm_checkpoint import KV_CACHE_QUANT_ALGOS
from triton_backend.engine.config import WEIGHTS_FILE, QuantConfig
from triton_backend.engine.families.llama import PROJECTIONS
from triton_backend.engine.quant import int4

QUANT_ALGO = "W4A16_ZERO_POINT"


def is_projection(module: str) -> bool:
    """A layer's projection, an expert's included (`mlp.experts.3.gate_up`); never the router."""
    kinds = tuple(p.rpartition(".")[2] for p in PROJECTIONS)
    return module.startswith("transformer.layers.") and module.rpartition(".")[2] in kinds


def quantize_projections(state: dict[str, torch.Tensor], options: QuantizeOptions,
                         dtype: torch.dtype,
                         quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
                         ) -> dict[str, torch.Tensor]:
    """Runtime weights (fp32) -> the same with each projection's weight not excluded replaced by
    `quantize(module, weight)`'s tensors (suffix -> tensor, `weight` among them); the rest cast
    to `dtype`."""
    modules = {key.rpartition(".")[0] for key in state} | {"lm_head"}  # a tied head is a module
    check_exclusion_patterns(options.exclude_modules, modules)
    out = {}
    for key, tensor in state.items():
        module, _, suffix = key.rpartition(".")
        if suffix == "weight" and is_projection(module) and not is_excluded(
                module, options.exclude_modules):
            out.update((f"{module}.{name}", value)
                       for name, value in quantize(module, tensor).items())
        else:
            out[key] = tensor.to(dtype)
    return out


def quantize_state(state: dict[str, torch.Tensor], options: QuantizeOptions,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every projection not excluded as packed INT4, `weights_scaling_factor` and `zero`."""
    def zero_point(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        int4.check_group_size(weight.shape[1], options.group_size, module)
        q, scales, zeros = int4.quantize_rtn_zero_point(weight, options.group_size)
        return {"weight": int4.pack(q), "weights_scaling_factor": scales, "zero": zeros}

    return quantize_projections(state, options, dtype, zero_point)


def dequantize_projections(model: nn.Module, options: QuantizeOptions) -> nn.Module:
    """Replace, in place, each HF projection `quantize_state` quantizes by its zero-point INT4
    dequantization (groups run along each row, so q/k/v or gate/up apart equal them fused)."""
    with torch.no_grad():
        for _, linear in modelopt_run.quantized_linears(model, options).values():
            q, scales, zeros = int4.quantize_rtn_zero_point(linear.weight, options.group_size)
            linear.weight.copy_(int4.dequantize(q, scales, zeros=zeros))
    return model


def attention_kv_scales(model: nn.Module) -> dict[str, list[float]]:
    """{"k": [...], "v": [...]} per layer from a model whose K/V quantizers ModelOpt calibrated:
    the scales ModelOpt's TensorRT-LLM export writes (amax/127 for int8, amax/448 clamped to
    >= 1 for FP8)."""
    from modelopt.torch.export.quant_utils import get_kv_cache_scaling_factor

    attentions = [m for m in model.modules() if hasattr(m, "k_bmm_quantizer")]
    layers = model.config.num_hidden_layers
    if len(attentions) != layers:
        raise RuntimeError(f"ModelOpt put K/V quantizers on {len(attentions)} attention modules "
                           f"of a {layers}-layer model")
    scales: dict[str, list[float]] = {"k": [], "v": []}
    for attention in attentions:
        k, v = get_kv_cache_scaling_factor(attention)
        if k is None or v is None:
            raise RuntimeError("a K/V quantizer recorded no amax: no calibration text reached it")
        scales["k"].append(float(k.reshape(-1)[0]))
        scales["v"].append(float(v.reshape(-1)[0]))
    return scales


def calibrate_kv_cache(hf_dir: Path, options: QuantizeOptions, progress: Callable[[str], None],
                       dequantize: Callable[[nn.Module, QuantizeOptions], nn.Module]
                       = dequantize_projections) -> tuple[dict[str, list[float]], dict]:
    """(per-layer K/V cache scales, the calibration's record) for a build whose weights are
    ours: ModelOpt's K/V quantizers over the checkpoint with its projections as `dequantize`
    leaves them (zero-point INT4's rounding by default)."""
    import modelopt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    dequantize(model, options)
    cal = options.calibration
    batches = calibration.windows(AutoTokenizer.from_pretrained(str(hf_dir)), cal)
    progress(f"calibrating the {options.kv_cache} KV cache on the {options.weights} weights: "
             f"{len(batches)} x {cal.seq_len} tokens of {cal.dataset!r}")
    kv_only = replace(options, weights="none", zero_point=False)
    modelopt_run.calibrate(model, kv_only, batches, progress)
    scales = attention_kv_scales(model)
    return scales, {"tool": f"nvidia-modelopt {modelopt.__version__}",
                    **calibration.record(cal, len(batches), time.perf_counter() - start)}


def quantize_zero_point(hf_dir: Path, engine_dir: Path, options: QuantizeOptions,
                        dtype: torch.dtype, progress: Callable[[str], None]) -> QuantizationResult:
    """Write engine_dir/model.safetensors; the result for the engine config."""
    start = time.perf_counter()
    shape = convert.model_shape_from_hf(convert.read_hf_config(hf_dir))
    state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), shape, torch.float32)
    progress(f"INT4 with zeros, group {options.group_size}, round-to-nearest (no calibration)")
    state = quantize_state(state, options, dtype)
    save_file(state, str(Path(engine_dir) / WEIGHTS_FILE), metadata={"format": "pt"})
    stored, bf16 = linear_bytes(state)
    progress(f"quantized in {time.perf_counter() - start:.0f}s; quantized linears "
             f"{stored / 2**20:.1f} MiB ({stored / bf16:.0%} of 16-bit)")
    extra = {"tool": "llm-forge", "quant_algo": QUANT_ALGO,
             "kv_cache_quant_algo": KV_CACHE_QUANT_ALGOS[options.kv_cache]}
    if options.kv_cache != "none":
        extra["kv_cache_scales"], extra["calibration"] = calibrate_kv_cache(hf_dir, options,
                                                                            progress)
    extra["seconds"] = round(time.perf_counter() - start, 1)
    return QuantizationResult(
        quantization=QuantConfig(weights=options.weights, kv_cache=options.kv_cache,
                                 group_size=options.group_size,
                                 exclude_modules=list(options.exclude_modules), zero_point=True),
        kv_cache_dtype="auto" if options.kv_cache == "none" else options.kv_cache,
        extra=extra, quantized_linear_bytes=stored, quantized_linear_bf16_bytes=bf16)

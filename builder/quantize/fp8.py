"""FP8 weights by llm-forge, for the families ModelOpt's TensorRT-LLM export refuses (Gemma 3,
Mixtral, Qwen3-MoE; the torch target only).

Every projection not excluded (each expert's too; never a router) is stored as float8_e4m3fn
with one scale per output row (its largest |w| / 448: a fused q/k/v or gate/up keeps each
part's own range), which `Fp8Linear` reads as `weights_scaling_factor` [out]. Its static
activation scale (`activation_scaling_factor`, what a GPU's FP8 GEMM quantizes the input by) is
the largest |input| the projection met over the calibration text / 448, measured by our own
runtime on the unquantized weights in float32, so every expert's rows are the ones the router
sends it. A one-byte KV cache is calibrated by ModelOpt's K/V quantizers on the unquantized
checkpoint, as for INT4 with zeros.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from builder.pipeline import convert
from builder.quantize import calibration
from builder.quantize.options import QuantizeOptions
from builder.quantize.result import QuantizationResult, linear_bytes
from builder.quantize.trtllm_checkpoint import KV_CACHE_QUANT_ALGOS
from builder.quantize.zero_point import (calibrate_kv_cache, is_projection,
                                         observe_projection_inputs, quantize_projections)
from builder.trtllm.families import OWN_WRITER
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig, QuantConfig
from triton_backend.engine.quant.linear import FP8_MAX

QUANT_ALGO = "FP8"
TINY = 1e-12  # a scale of an all-zero row or an input never seen


def takes_own_fp8(hf_dir: Path) -> bool:
    """FP8 for this checkpoint is ours: ModelOpt's export refuses its family."""
    return convert.model_shape_from_hf(convert.read_hf_config(hf_dir)).architecture in OWN_WRITER


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn weight, fp32 scales [out]) with w ~= q * scale per row."""
    scales = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp(min=TINY)
    q = (weight.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def expert_kind(module: str) -> str | None:
    """`transformer.layers.L.mlp.experts.*.gate_up` for an expert's projection, else None."""
    parts = module.split(".")
    if len(parts) > 5 and parts[3:5] == ["mlp", "experts"]:
        return ".".join(parts[:5] + ["*"] + parts[6:])
    return None


def activation_amax(modules: list[str], measured: dict[str, float]) -> tuple[dict[str, float], int]:
    """(each projection's input amax, how many took another's): an expert the router sent no
    calibration row takes the largest of its layer's experts of the same kind (gate_up's all
    read the same hidden states), and one of a layer no row reached FP8_MAX (scale 1)."""
    siblings: dict[str, float] = {}
    for module, amax in measured.items():
        kind = expert_kind(module)
        if kind is not None:
            siblings[kind] = max(siblings.get(kind, 0.0), amax)
    amax, borrowed = {}, 0
    for module in modules:
        if measured.get(module, 0.0) > 0.0:
            amax[module] = measured[module]
            continue
        borrowed += 1
        amax[module] = siblings.get(expert_kind(module) or "", 0.0) or FP8_MAX
    return amax, borrowed


def quantize_state(state: dict[str, torch.Tensor], amax: dict[str, float],
                   options: QuantizeOptions, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every projection not excluded in FP8: weight, per-row scales, the activation scale
    (`amax` / 448)."""
    def fp8(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_weight(weight)
        activation = torch.tensor([max(amax[module] / FP8_MAX, TINY)], dtype=torch.float32)
        return {"weight": q, "weights_scaling_factor": scales,
                "activation_scaling_factor": activation}

    return quantize_projections(state, options, dtype, fp8)


def input_amax(state: dict[str, torch.Tensor], config: EngineConfig, windows: torch.Tensor
               ) -> dict[str, float]:
    """Projection name -> the largest |input| it meets when our runtime, in float32 on the CPU,
    prefills each calibration window (a request of its own)."""
    found: dict[str, float] = {}

    def record(name: str, rows: torch.Tensor) -> None:
        found[name] = max(found.get(name, 0.0), float(rows.abs().max()))

    observe_projection_inputs(state, config, windows, record)
    return found


def quantize_fp8(hf_dir: Path, engine_dir: Path, options: QuantizeOptions, dtype: torch.dtype,
                 config: EngineConfig, progress: Callable[[str], None]) -> QuantizationResult:
    """Write engine_dir/model.safetensors; the result for the engine config."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), config.model,
                                       torch.float32)
    cal = options.calibration
    windows = calibration.windows(AutoTokenizer.from_pretrained(str(hf_dir)), cal)
    progress(f"FP8 weights (one scale per output row), activation scales from our runtime on "
             f"{len(windows)} x {cal.seq_len} tokens of {cal.dataset!r}")
    projections = [key.rpartition(".")[0] for key in state if key.endswith(".weight")
                   and is_projection(key.rpartition(".")[0])]
    amax, borrowed = activation_amax(projections, input_amax(state, config, windows))
    record = calibration.record(cal, len(windows), time.perf_counter() - start)
    if borrowed:
        progress(f"{borrowed} of {len(projections)} projections met no calibration row (experts "
                 f"the router never chose): each takes its layer's largest of its kind")
    state = quantize_state(state, amax, options, dtype)
    save_file(state, str(Path(engine_dir) / WEIGHTS_FILE), metadata={"format": "pt"})
    stored, bf16 = linear_bytes(state)
    progress(f"quantized in {time.perf_counter() - start:.0f}s; quantized linears "
             f"{stored / 2**20:.1f} MiB ({stored / bf16:.0%} of 16-bit)")
    extra = {"tool": "llm-forge", "quant_algo": QUANT_ALGO, "calibration": record,
             "activation_scales_borrowed": borrowed,
             "kv_cache_quant_algo": KV_CACHE_QUANT_ALGOS[options.kv_cache]}
    if options.kv_cache != "none":
        extra["kv_cache_scales"], extra["kv_cache_calibration"] = calibrate_kv_cache(
            hf_dir, options, progress, dequantize=lambda model, _options: model)
    extra["seconds"] = round(time.perf_counter() - start, 1)
    return QuantizationResult(
        quantization=QuantConfig(weights="fp8", kv_cache=options.kv_cache,
                                 group_size=options.group_size,
                                 exclude_modules=list(options.exclude_modules)),
        kv_cache_dtype="auto" if options.kv_cache == "none" else options.kv_cache,
        extra=extra, quantized_linear_bytes=stored, quantized_linear_bf16_bytes=bf16)

"""INT4 with a zero per group, by llm-forge: asymmetric rounding, no TensorRT-LLM checkpoint (the
torch target only).

A checkpoint whose projections already sit on an asymmetric 4-bit grid (a GGUF Q4_1 export such as
the demo model, a GPTQ/AWQ-with-zeros export) is reproduced by it instead of re-rounded onto the
symmetric grid `int4_awq`/`int4_rtn` use, which costs such a model most of its quality.

`quantization.rounding` picks each group's grid: `minmax` (its min and max are the grid's ends,
no calibration), `search` (llama.cpp's k-quant search: candidate scales, each refit by least
squares) or `activation` (the search weighted per input column by the RMS activation our runtime
meets over the calibration text, the idea of llama.cpp's importance matrix). A checkpoint whose
projections were stored at more than 4 bits (Gemma 3 270M's Q4_K_M GGUF holds most of them as
Q5_0, Q6_K or Q8_0) loses much less to the searched grids.

A one-byte KV cache (`kv_cache: int8 | fp8`) is calibrated in every case: its per-layer scales
come from ModelOpt's K/V quantizers run over the calibration text on the checkpoint with
every quantized projection replaced by its INT4 dequantization, so the keys and values measured
are the ones the engine will write.
"""
from __future__ import annotations

import copy
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from builder.pipeline import convert
from builder.quantize import calibration, modelopt_run
from builder.quantize.modelopt_run import check_exclusion_patterns, is_excluded
from builder.quantize.options import QuantizeOptions
from builder.quantize.result import QuantizationResult, linear_bytes
from builder.quantize.trtllm_checkpoint import KV_CACHE_QUANT_ALGOS
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig, QuantConfig, SpeculativeConfig
from triton_backend.engine.families.llama import PROJECTIONS
from triton_backend.engine.quant import int4

QUANT_ALGO = "W4A16_ZERO_POINT"


def is_projection(module: str) -> bool:
    """A layer's projection, an expert's included (`mlp.experts.3.gate_up`); never the router."""
    kinds = tuple(p.rpartition(".")[2] for p in PROJECTIONS)
    return module.startswith("transformer.layers.") and module.rpartition(".")[2] in kinds


@contextmanager
def _torch_ops() -> Iterator[None]:
    """The runtime's pure-torch ops: every projection a module call that a hook sees (the CPU
    backend runs a short step, and a mixture of experts, inside one kernel call)."""
    from triton_backend.engine.cpu.kernels import ENV_SWITCH

    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def observe_projection_inputs(state: dict[str, torch.Tensor], config: EngineConfig,
                              windows: torch.Tensor,
                              observe: Callable[[str, torch.Tensor], None]) -> None:
    """Prefill each calibration window (a request of its own) through our runtime, in float32
    on the CPU, with the unquantized runtime weights `state`; `observe(projection, rows)` sees
    each projection's input rows [n, in] (an expert's: the rows its router sends it)."""
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate
    from triton_backend.engine.request import Request

    plain = copy.deepcopy(config)
    plain.dtype, plain.hardware, plain.quantization, plain.lora = "float32", "cpu", QuantConfig(), None
    plain.kv_cache.dtype, plain.speculative = "auto", SpeculativeConfig()
    with tempfile.TemporaryDirectory(prefix="calibration-") as tmp, _torch_ops():
        plain.save(tmp)
        save_file(state, str(Path(tmp) / WEIGHTS_FILE), metadata={"format": "pt"})
        engine = LLMEngine(tmp, enable_prefix_caching=False, device="cpu")
        hooks = [module.register_forward_hook(
                     lambda _module, args, _out, name=name: observe(
                         name, args[0].reshape(-1, args[0].shape[-1])))
                 for name, module in engine.runner.model.named_modules()
                 if isinstance(module, nn.Linear) and is_projection(name)]
        try:
            generate(engine, [Request(input_token_ids=row.tolist(), max_tokens=1)
                              for row in windows])
        finally:
            for hook in hooks:
                hook.remove()


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


Grid = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def zero_point_grid(options: QuantizeOptions,
                    importance: dict[str, torch.Tensor] | None = None) -> Grid:
    """(runtime module, weight [out, in]) -> (q, scales, zeros) by `options.rounding`;
    `importance` (projection -> [in]) weights the `activation` search (a projection the
    calibration never reached, searched unweighted)."""
    def grid(module: str, weight: torch.Tensor):
        int4.check_group_size(weight.shape[1], options.group_size, module)
        if options.rounding == "minmax":
            return int4.quantize_rtn_zero_point(weight, options.group_size)
        return int4.quantize_search_zero_point(weight, options.group_size,
                                               (importance or {}).get(module))
    return grid


def input_rms(state: dict[str, torch.Tensor], config: EngineConfig, windows: torch.Tensor
              ) -> dict[str, torch.Tensor]:
    """Projection name -> the RMS of each of its input columns over the calibration windows,
    as our runtime meets them (`observe_projection_inputs`)."""
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def record(name: str, x: torch.Tensor) -> None:
        square = x.float().square().sum(0)
        sums[name] = square if name not in sums else sums[name] + square
        rows[name] = rows.get(name, 0) + x.shape[0]

    observe_projection_inputs(state, config, windows, record)
    return {name: (total / rows[name]).sqrt() for name, total in sums.items()}


def quantize_state(state: dict[str, torch.Tensor], options: QuantizeOptions,
                   dtype: torch.dtype, grid: Grid | None = None) -> dict[str, torch.Tensor]:
    """Every projection not excluded as packed INT4, `weights_scaling_factor` and `zero`."""
    grid = grid or zero_point_grid(options)

    def zero_point(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales, zeros = grid(module, weight)
        return {"weight": int4.pack(q), "weights_scaling_factor": scales, "zero": zeros}

    return quantize_projections(state, options, dtype, zero_point)


def dequantize_projections(model: nn.Module, options: QuantizeOptions,
                           grid: Grid | None = None) -> nn.Module:
    """Replace, in place, each HF projection `quantize_state` quantizes by its zero-point INT4
    dequantization on the same `grid` (groups run along each row, so q/k/v or gate/up apart
    equal them fused, an importance shared by a fused projection's parts included)."""
    grid = grid or zero_point_grid(options)
    with torch.no_grad():
        for target, linear in modelopt_run.quantized_linears(model, options).values():
            q, scales, zeros = grid(target, linear.weight)
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
                        dtype: torch.dtype, progress: Callable[[str], None],
                        config: EngineConfig | None = None) -> QuantizationResult:
    """Write engine_dir/model.safetensors; the result for the engine config (`config`, the
    engine's, runs the `activation` rounding's calibration)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    shape = convert.model_shape_from_hf(convert.read_hf_config(hf_dir))
    state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), shape, torch.float32)
    extra = {"tool": "llm-forge", "quant_algo": QUANT_ALGO, "rounding": options.rounding,
             "kv_cache_quant_algo": KV_CACHE_QUANT_ALGOS[options.kv_cache]}
    importance = None
    if options.rounding == "activation":
        if config is None:
            raise ValueError("quantization.rounding: activation calibrates through the engine "
                             "being built; no engine config was given")
        cal = options.calibration
        windows = calibration.windows(AutoTokenizer.from_pretrained(str(hf_dir)), cal)
        progress(f"activation RMS per input column from our runtime on {len(windows)} x "
                 f"{cal.seq_len} tokens of {cal.dataset!r}")
        importance = input_rms(state, config, windows)
        extra["rounding_calibration"] = calibration.record(cal, len(windows),
                                                           time.perf_counter() - start)
    grid = zero_point_grid(options, importance)
    how = {"minmax": "round-to-nearest on each group's min/max (no calibration)",
           "search": "each group's grid searched by least squares",
           "activation": "each group's grid searched, weighted by activation RMS"}
    progress(f"INT4 with zeros, group {options.group_size}, {how[options.rounding]}")
    state = quantize_state(state, options, dtype, grid)
    save_file(state, str(Path(engine_dir) / WEIGHTS_FILE), metadata={"format": "pt"})
    stored, bf16 = linear_bytes(state)
    progress(f"quantized in {time.perf_counter() - start:.0f}s; quantized linears "
             f"{stored / 2**20:.1f} MiB ({stored / bf16:.0%} of 16-bit)")
    if options.kv_cache != "none":
        extra["kv_cache_scales"], extra["calibration"] = calibrate_kv_cache(
            hf_dir, options, progress,
            dequantize=lambda model, opts: dequantize_projections(model, opts, grid))
    extra["seconds"] = round(time.perf_counter() - start, 1)
    return QuantizationResult(
        quantization=QuantConfig(weights=options.weights, kv_cache=options.kv_cache,
                                 group_size=options.group_size,
                                 exclude_modules=list(options.exclude_modules), zero_point=True),
        kv_cache_dtype="auto" if options.kv_cache == "none" else options.kv_cache,
        extra=extra, quantized_linear_bytes=stored, quantized_linear_bf16_bytes=bf16)

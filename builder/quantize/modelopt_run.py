"""Calibrate and quantize a Hugging Face model with NVIDIA ModelOpt (what TensorRT-LLM uses).

- `int4_awq`: ModelOpt's `INT4_AWQ_CFG` (awq_lite): per linear, a search over the smoothing exponent
  alpha of s = act_scale^alpha / weight_scale^(1-alpha) minimising the output error on calibration
  activations; weights then symmetric INT4 per group with the pre-quant scale kept.
- `int4_rtn`: the same INT4 format with `max` calibration (round-to-nearest, no smoothing).
- `fp8`: `FP8_DEFAULT_CFG` (e4m3 weights and static per-tensor activation scales).
- `kv_cache` fp8 / int8: ModelOpt's K/V BMM quantizers record per-layer amax on calibration data.

Calibration runs in float32 on a CPU: bfloat16 matmuls are far slower there and gain nothing.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch
from torch import nn

from builder.pipeline.progress import Eta
from builder.quantize.options import QuantizeOptions
from triton_backend.engine import families
from triton_backend.engine.quant import int4

Progress = Callable[[str], None]
AWQ_SEARCH_COST = 12.0  # awq_lite's search batch in statistics batches: 11 alphas + the pass

def require_modelopt():
    """Import ModelOpt or explain how to get it (the `quant` extra)."""
    try:
        import modelopt.torch.quantization as mtq  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("quantization needs NVIDIA ModelOpt: pip install 'llm-forge[quant]' "
                           "(or `make setup`)") from exc
    return mtq


def family_of(model: nn.Module):
    """The model family (engine/families/) of an HF model, whose table names the runtime modules;
    None for a module that is not an HF model (nothing in it has a runtime name)."""
    config = getattr(model, "config", None)
    return None if config is None else families.for_model_type(config.model_type)


def runtime_names(model: nn.Module) -> dict[str, str]:
    """HF module name -> runtime module name (`model.layers.3.mlp.up_proj` ->
    `transformer.layers.3.mlp.gate_up`, `lm_head` -> `lm_head`) for the model's projections."""
    family = family_of(model)
    if family is None:
        return {}
    names = ((name, family.runtime_name(name)) for name, _ in model.named_modules())
    return {name: target for name, target in names if target}


def is_excluded(name: str, patterns: list[str]) -> bool:
    """The runtime's rule (layers.make_linear): a pattern excludes every module whose name contains it."""
    return any(pattern in name for pattern in patterns)


def quantized_linears(model: nn.Module, options: QuantizeOptions
                      ) -> dict[str, tuple[str, nn.Linear]]:
    """HF name -> (runtime name, linear) for every projection that will be quantized
    (exclusions applied)."""
    found, targets = {}, runtime_names(model)
    for name, module in model.named_modules():
        target = targets.get(name)
        if isinstance(module, nn.Linear) and target and target != "lm_head":
            if not is_excluded(target, options.exclude_modules):
                found[name] = (target, module)
    return found


def check_exclusions(model: nn.Module, options: QuantizeOptions) -> None:
    """Every `exclude_modules` pattern must name something: a typo would quantize silently."""
    check_exclusion_patterns(options.exclude_modules, set(runtime_names(model).values()))


def check_exclusion_patterns(patterns: list[str], names: set[str]) -> None:
    """Raise naming the first pattern that matches none of the runtime module `names`."""
    for pattern in patterns:
        if not any(pattern in name for name in names):
            raise ValueError(f"quantization.exclude_modules: {pattern!r} matches no module (names "
                             f"look like transformer.layers.0.attention.qkv, .attention.dense, "
                             f".mlp.gate_up, .mlp.proj, lm_head)")


def check_group_size(model: nn.Module, options: QuantizeOptions) -> None:
    """Before any calibration: every INT4 linear's input size must divide by the group size."""
    if options.weights not in ("int4_awq", "int4_rtn"):
        return
    for target, linear in quantized_linears(model, options).values():
        int4.check_group_size(linear.in_features, options.group_size, target)


def modelopt_config(model: nn.Module, options: QuantizeOptions) -> dict:
    """The ModelOpt quantization config for `options` (a deep copy of its preset, adjusted)."""
    mtq = require_modelopt()
    presets = {"int4_awq": mtq.INT4_AWQ_CFG, "int4_rtn": mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
               "fp8": mtq.FP8_DEFAULT_CFG}
    if options.weights in presets:
        config = copy.deepcopy(presets[options.weights])
    else:  # KV cache only: every weight stays as it is
        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    for entry in config["quant_cfg"]:
        block_sizes = entry.get("cfg", {}).get("block_sizes") if isinstance(entry, dict) else None
        if block_sizes and entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {-1: options.group_size, "type": "static"}
    targets = runtime_names(model)
    for name, module in model.named_modules():
        target = targets.get(name)
        if isinstance(module, nn.Linear) and target and is_excluded(target, options.exclude_modules):
            config["quant_cfg"].append({"quantizer_name": f"{name}.*", "enable": False})
    if options.kv_cache != "none":
        bits = (4, 3) if options.kv_cache == "fp8" else 8
        config["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer",
                                    "cfg": {"num_bits": bits, "axis": None}})
    return config


def calibrate(model: nn.Module, options: QuantizeOptions, batches: torch.Tensor,
              progress: Progress) -> nn.Module:
    """Quantize `model` in place with ModelOpt, feeding `batches` [n, seq_len] through it."""
    mtq = require_modelopt()
    check_group_size(model, options)
    config = modelopt_config(model, options)
    batch_size = options.calibration.batch_size
    per_pass = -(-len(batches) // batch_size)
    # awq_lite runs the loop twice: statistics, then the search, dearer by about its grid of
    # alphas (each one more pass of every linear); the estimate measures it once it starts.
    costs = [1.0] * per_pass + ([AWQ_SEARCH_COST] * per_pass if options.weights == "int4_awq"
                                else [])
    eta = Eta("calibration batch", len(costs), progress, costs)

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for start in range(0, len(batches), batch_size):
                m(batches[start:start + batch_size])
                eta.tick()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt warns about CUDA extensions absent on a CPU
        mtq.quantize(model, config, forward_loop)
    if options.weights == "int4_awq":
        share_prequant_scales(model)
    return model


def share_prequant_scales(model: nn.Module) -> None:
    """Give linears that read one input (QKV; gate/up) one pre-quant scale, re-quantizing their
    weights for it (ModelOpt's resmoothing), so the runtime can run them as one fused GEMM."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    family = family_of(model)
    if family is None:
        return
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) != 3 or parts[:2] != ["model", "layers"]:
            continue
        for group in family.fused_input_groups():
            linears = [module.get_submodule(n) for n in group]
            if all(getattr(lin, "input_quantizer", None) is not None and
                   lin.input_quantizer.pre_quant_scale is not None for lin in linears):
                preprocess_linear_fusion(linears, resmooth_only=True)

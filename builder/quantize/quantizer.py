"""One quantization run: HF checkpoint -> TensorRT-LLM checkpoint + the runtime's weights.

    hf_dir ──ModelOpt (calibrate)──► engine_dir/trtllm_checkpoint/{config.json, rank0.safetensors}
                                            │ repack (fuse gate/up, drop tied lm_head)
                                            ▼
                                     engine_dir/model.safetensors  + QuantizationResult
                                     (the builder records result in the engine's config.json)
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from builder.quantize import calibration, modelopt_run, repack, trtllm_checkpoint
from builder.quantize.options import QuantizeOptions
from builder.quantize.result import QuantizationResult, linear_bytes
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig, QuantConfig

Progress = Callable[[str], None]


def quantize_checkpoint(hf_dir: str | Path, engine_dir: str | Path, options: QuantizeOptions,
                        dtype: torch.dtype = torch.bfloat16, progress: Progress | None = None,
                        parallelism: tuple[int, int] = (1, 1), config: EngineConfig | None = None
                        ) -> QuantizationResult:
    """Calibrate and quantize `hf_dir` per `options`; write `engine_dir/trtllm_checkpoint/` and
    `engine_dir/model.safetensors` (unquantized tensors in `dtype`). The caller records the
    returned result in the engine config (`result.apply(config)`) and writes config.json.
    `parallelism` (tp, pp) splits the TensorRT-LLM checkpoint into ranks; the runtime's weights
    are repacked from a single-rank export of the same calibrated model.

    FP8 for a family ModelOpt cannot export (`fp8.takes_own_fp8`) is ours and needs the engine's
    `config` (its activation scales are measured by our runtime).

    Raises ValueError (bad group size, too little calibration text) before any long work.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress = progress or (lambda message: None)
    hf_dir, engine_dir = Path(hf_dir), Path(engine_dir)
    if options.zero_point:  # ours, without ModelOpt or a TensorRT-LLM checkpoint
        from builder.quantize.zero_point import quantize_zero_point

        return quantize_zero_point(hf_dir, engine_dir, options, dtype, progress, config)
    if options.weights == "fp8" and config is not None:
        from builder.quantize import fp8

        if fp8.takes_own_fp8(hf_dir):
            return fp8.quantize_fp8(hf_dir, engine_dir, options, dtype, config, progress)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    modelopt_run.check_exclusions(model, options)
    modelopt_run.check_group_size(model, options)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    cal = options.calibration
    batches = calibration.windows(tokenizer, cal)
    progress(f"calibrating {options.weights} weights / {options.kv_cache} KV cache on "
             f"{len(batches)} x {cal.seq_len} tokens of {cal.dataset!r}")
    start = time.perf_counter()
    modelopt_run.calibrate(model, options, batches, progress)
    seconds = time.perf_counter() - start
    ckpt_dir = engine_dir / trtllm_checkpoint.CHECKPOINT_DIR
    single_rank_dir = ckpt_dir if parallelism == (1, 1) else engine_dir / "trtllm_checkpoint.rank1"
    trtllm_checkpoint.export(model, model.config.to_dict(), dtype, single_rank_dir)
    ckpt_config, tensors = trtllm_checkpoint.read(single_rank_dir)
    if single_rank_dir != ckpt_dir:
        trtllm_checkpoint.export(model, model.config.to_dict(), dtype, ckpt_dir, *parallelism)
        shutil.rmtree(single_rank_dir)
    state, kv_scales = repack.to_runtime_weights(ckpt_config, tensors,
                                                 bool(model.config.tie_word_embeddings))
    save_file(state, str(engine_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    stored, bf16 = linear_bytes(state)
    progress(f"calibrated in {seconds:.0f}s; quantized linears {stored / 2**20:.1f} MiB "
             f"({stored / bf16:.0%} of 16-bit)" if bf16 else f"calibrated in {seconds:.0f}s")
    return QuantizationResult(
        quantization=QuantConfig(weights=options.weights, kv_cache=options.kv_cache,
                                 group_size=options.group_size,
                                 exclude_modules=list(options.exclude_modules)),
        kv_cache_dtype="auto" if options.kv_cache == "none" else options.kv_cache,
        extra=_extra(options, ckpt_config, kv_scales, len(batches), seconds),
        quantized_linear_bytes=stored, quantized_linear_bf16_bytes=bf16)


def _extra(options: QuantizeOptions, ckpt_config: dict, kv_scales: dict, samples: int,
           seconds: float) -> dict:
    import modelopt

    quant_algo, kv_algo = trtllm_checkpoint.checkpoint_quant_modes(ckpt_config)
    extra = {"tool": f"nvidia-modelopt {modelopt.__version__}",
             "trtllm_checkpoint": trtllm_checkpoint.CHECKPOINT_DIR,
             "quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo,
             "calibration": calibration.record(options.calibration, samples, seconds)}
    if kv_scales:
        extra["kv_cache_scales"] = kv_scales
    return extra


def quantize_engine(engine_dir: str | Path, hf_dir: str | Path, options: QuantizeOptions,
                    progress: Progress | None = None) -> QuantizationResult:
    """Quantize a built (unquantized) engine in place from its source checkpoint: replaces
    model.safetensors, adds trtllm_checkpoint/, records the result in config.json."""
    from triton_backend.engine.weights import TORCH_DTYPES

    config = EngineConfig.load(engine_dir)
    if config.quantization.weights != "none" or config.kv_cache.dtype != "auto":
        raise ValueError(f"{engine_dir}: already quantized ({config.quantization.weights} weights, "
                         f"{config.kv_cache.dtype} KV cache); rebuild it from the checkpoint")
    result = quantize_checkpoint(hf_dir, engine_dir, options, TORCH_DTYPES[config.dtype], progress,
                                 config=config)
    result.apply(config)
    config.save(engine_dir)
    return result

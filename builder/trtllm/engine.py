"""Build a `trtllm` target engine: TensorRT-LLM checkpoint per rank -> `trtllm-build` -> engine.

    engine_dir/
      config.json          ours (target trtllm; `extra.trtllm` holds the build plan and profile)
      manifest.json        hashes, versions, the toolchain that built the engine
      tokenizer/
      trtllm_checkpoint/   config.json + rank{N}.safetensors, tp x pp ranks (ModelOpt's exporter;
                           for the families it refuses, ours: builder/trtllm/checkpoint.py)
      build.sh             the exact trtllm-build command (run it on a GPU host)
      trtllm_engine/       what trtllm-build wrote (rank{N}.engine + config.json), when it ran
      build.log            trtllm-build's output

Where `tensorrt_llm` does not import, the build stops after the checkpoint with a message and
leaves `build.sh`. Quantized builds run the quality gate on the same quantized weights through the
torch runtime (in a scratch copy; `quality.json` is kept).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from builder.spec.hardware import PROFILES, memory_plan, sized_limits
from builder.pipeline.manifest import write_manifest
from builder.spec.build_spec import BuildSpec
from builder.trtllm import families as trtllm_families
from builder.trtllm.lora import trtllm_lora, write_trtllm_adapters
from builder.trtllm.build import (BUILD_SCRIPT, CHECKPOINT_SUBDIR, PINNED_TRTLLM, TrtllmBuildPlan,
                                  run_build, trtllm_available, write_build_script)
from triton_backend.engine.config import EngineConfig, ModelShape


def check_parallelism(shape: ModelShape, tp: int, pp: int) -> None:
    """TensorRT-LLM splits heads over tp (KV heads replicated when tp exceeds them), layers over pp."""
    if shape.num_attention_heads % tp:
        raise ValueError(f"parallelism.tp ({tp}) must divide the model's "
                         f"{shape.num_attention_heads} attention heads")
    kv = shape.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"parallelism.tp ({tp}) must divide or be a multiple of the model's "
                         f"{kv} KV heads")
    if pp > shape.num_hidden_layers:
        raise ValueError(f"parallelism.pp ({pp}) exceeds the model's {shape.num_hidden_layers} layers")


def plan_engine(spec: BuildSpec, config: EngineConfig) -> TrtllmBuildPlan:
    """Size the limits for the profile, record the plan in `config`; returns the build plan.

    Raises ValueError naming the field when the model does not fit or cannot be split.
    """
    profile = PROFILES[spec.hardware]
    tp, pp = spec.parallelism.tp, spec.parallelism.pp
    trtllm_families.check_buildable(config.model, spec)
    check_parallelism(config.model, tp, pp)
    moe = config.model.num_experts > 0
    fraction = (spec.repository or {}).get("kv_cache_free_gpu_mem_fraction")
    memory = memory_plan(config.model, profile, spec.quantization.weights,
                         spec.quantization.kv_cache, tp, pp, fraction)
    config.limits = sized_limits(config.model, profile, memory, spec.kv_cache.tokens_per_block,
                                 spec.limits)
    plan = TrtllmBuildPlan(dtype=spec.dtype, limits=config.limits,
                           tokens_per_block=spec.kv_cache.tokens_per_block,
                           weights=spec.quantization.weights, kv_cache=spec.quantization.kv_cache,
                           profile=profile, lora=trtllm_lora(spec, spec.dtype), moe=moe)
    plugins = plan.plugins()
    config.features.gpt_attention_plugin = plugins["gpt_attention_plugin"]
    config.features.gemm_plugin = plugins["gemm_plugin"]
    config.extra["trtllm"] = {
        "version": PINNED_TRTLLM, "hardware": profile.name, "sm": profile.sm, "tp": tp, "pp": pp,
        "checkpoint_dir": CHECKPOINT_SUBDIR, "build_script": BUILD_SCRIPT,
        "command": plan.shell_command(), "plugins": {
            "use_paged_context_fmha": plan.paged_context_fmha,
            "use_fp8_context_fmha": plan.fp8_context_fmha},
        "kv_cache_free_gpu_mem_fraction": fraction or profile.kv_cache_free_gpu_mem_fraction,
        "memory": {"weights_bytes": memory.weights_bytes, "kv_budget_bytes": memory.kv_budget_bytes,
                   "kv_tokens": memory.kv_tokens},
        "checkpoint_writer": ("llm-forge" if trtllm_families.uses_own_writer(config.model)
                              else "modelopt"),
    }
    if moe:
        moe_tp, moe_ep = spec.parallelism.moe_split
        config.extra["trtllm"].update(moe_tp=moe_tp, moe_ep=moe_ep)
    windows = trtllm_families.attention_windows(config.model, config.limits.max_seq_len)
    if windows is not None:  # what the runtime's max_attention_window_size must say per layer
        config.extra["trtllm"]["max_attention_window"] = windows
    return plan


def _write_own_checkpoint(hf_dir: Path, out_dir: Path, spec: BuildSpec, shape: ModelShape,
                          log) -> None:
    """A family ModelOpt's exporter refuses: our writer, from the runtime-layout weights."""
    from builder.pipeline.convert import load_hf_state_dict
    from builder.trtllm.checkpoint import write_checkpoint
    from triton_backend.engine import families
    from triton_backend.engine.weights import TORCH_DTYPES

    family = families.get(shape.architecture)
    hf_state = load_hf_state_dict(hf_dir)
    state = family.convert_state_dict(hf_state, shape, TORCH_DTYPES[spec.dtype])
    if shape.num_experts:  # TensorRT-LLM routes in float32: the router from the checkpoint's
        for layer in range(shape.num_hidden_layers):
            state[f"transformer.layers.{layer}.mlp.router.weight"] = \
                hf_state[f"model.layers.{layer}.{getattr(family, 'router')}.weight"].float()
    write_checkpoint(state, shape, spec.dtype, out_dir, spec.parallelism.tp, spec.parallelism.pp,
                     spec.parallelism.moe_split)
    log(f"{spec.dtype} checkpoint of {trtllm_families.OWN_WRITER[shape.architecture]}, "
        f"{spec.parallelism.world_size} rank(s)")


def _export_unquantized(hf_dir: Path, out_dir: Path, spec: BuildSpec, shape: ModelShape,
                        log) -> None:
    if trtllm_families.uses_own_writer(shape):
        _write_own_checkpoint(hf_dir, out_dir, spec, shape, log)
        return
    import torch
    from transformers import AutoModelForCausalLM

    from builder.quantize import trtllm_checkpoint
    from triton_backend.engine.weights import TORCH_DTYPES

    dtype = TORCH_DTYPES[spec.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    with torch.inference_mode():
        trtllm_checkpoint.export(model, model.config.to_dict(), dtype, out_dir,
                                 spec.parallelism.tp, spec.parallelism.pp)
    log(f"{spec.dtype} checkpoint, {spec.parallelism.world_size} rank(s)")


def _write_checkpoint(spec: BuildSpec, config: EngineConfig, hf_dir: Path, tmp_dir: Path,
                      steps) -> bool:
    """The TensorRT-LLM checkpoint in tmp_dir; True when it was quantized."""
    from builder.quantize import QuantizeOptions

    options = QuantizeOptions.from_spec(spec.quantization)
    if not options.enabled:
        with steps.step(f"TensorRT-LLM checkpoint ({spec.dtype}, tp {spec.parallelism.tp}, "
                        f"pp {spec.parallelism.pp})") as log:
            _export_unquantized(hf_dir, tmp_dir / CHECKPOINT_SUBDIR, spec, config.model, log)
        return False
    from builder.quantize import quantize_checkpoint
    from triton_backend.engine.weights import TORCH_DTYPES

    with steps.step(f"quantize: weights {options.weights}, KV cache {options.kv_cache} "
                    f"(calibration, TensorRT-LLM checkpoint per rank)") as log:
        result = quantize_checkpoint(hf_dir, tmp_dir, options, TORCH_DTYPES[spec.dtype],
                                     progress=log, parallelism=(spec.parallelism.tp,
                                                                spec.parallelism.pp))
        result.apply(config)
    return True


def _quality_gate(engine_dir: Path, config: EngineConfig, hf_dir: Path, spec: BuildSpec,
                  log) -> None:
    """The gate on the quantized weights through the torch runtime, in a scratch engine copy."""
    from builder.quality.gate import run_quality_gate
    from builder.quality.metrics import QualityThresholds
    from triton_backend.engine.config import TOKENIZER_DIR, WEIGHTS_FILE

    scratch = engine_dir / "quality_check"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        shutil.move(str(engine_dir / WEIGHTS_FILE), scratch / WEIGHTS_FILE)
        shutil.copytree(engine_dir / TOKENIZER_DIR, scratch / TOKENIZER_DIR)
        torch_config = EngineConfig.from_dict({**config.to_dict(), "target": "torch"})
        torch_config.save(scratch)
        run_quality_gate(scratch, hf_dir, QualityThresholds.from_spec(spec.quantization.quality),
                         progress=log, echo=log)
    finally:
        for name in ("quality.json",):
            if (scratch / name).is_file():
                shutil.move(str(scratch / name), engine_dir / name)
        shutil.rmtree(scratch, ignore_errors=True)


def build_trtllm_engine(spec: BuildSpec, config: EngineConfig, hf_dir: Path, steps,
                        plan: TrtllmBuildPlan) -> Path:
    """Checkpoint, config, manifest and build.sh; then trtllm-build where it can run."""
    from builder.pipeline.engine_files import copy_tokenizer

    from builder.pipeline.install import check_replaceable, staging_dir, swap_in

    engine_dir = spec.output_dir
    check_replaceable(engine_dir)
    tmp_dir = staging_dir(engine_dir)
    quantized = _write_checkpoint(spec, config, hf_dir, tmp_dir, steps)
    if spec.lora is not None:
        with steps.step(f"LoRA adapters: {len(spec.lora.adapters)} checked, PEFT files for "
                        f"--lora_dir, NVIDIA's lora_weights/lora_config") as log:
            try:
                config.lora = write_trtllm_adapters(spec.lora, config.model, tmp_dir, log)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
    with steps.step("tokenizer, config.json, manifest.json, build.sh") as log:
        copy_tokenizer(hf_dir, tmp_dir)
        config.save(tmp_dir)
        write_manifest(tmp_dir, spec, hf_dir)
        write_build_script(tmp_dir, plan, f"trtllm-build for {spec.name} on {spec.hardware} "
                           f"(TensorRT-LLM {PINNED_TRTLLM}.x); written by llm-forge.")
        log(f"limits: batch {config.limits.max_batch_size}, tokens/step "
            f"{config.limits.max_num_tokens}, input {config.limits.max_input_len}, "
            f"sequence {config.limits.max_seq_len}")
    if quantized:  # on the staged engine: a rejected one never replaces a good one
        with steps.step("quality gate: quantized weights vs the unquantized checkpoint") as log:
            try:
                _quality_gate(tmp_dir, config, hf_dir, spec, log)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
    swap_in(tmp_dir, engine_dir)
    with steps.step("trtllm-build") as log:
        missing = trtllm_available()
        if missing:
            log(f"stopped after the checkpoint: {missing}. On a GPU host with TensorRT-LLM "
                f"{PINNED_TRTLLM}.x run {engine_dir / BUILD_SCRIPT}")
        else:
            run_build(engine_dir, plan, log)
            write_manifest(engine_dir, spec, hf_dir)  # now with the toolchain that built it
            log(f"engine written to {engine_dir / 'trtllm_engine'}")
    return engine_dir

"""`forge engine`: spec -> checkpoint -> engine directory (-> repository), one visible step at a time."""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from rich.console import Console
from safetensors.torch import save_file

from builder.pipeline import convert
from builder.pipeline.engine_files import copy_tokenizer, engine_config_for
from builder.pipeline.checkpoint import resolve_checkpoint
from builder.errors import QualityGateError
from builder.pipeline.install import check_replaceable, staging_dir, swap_in
from builder.pipeline.manifest import write_manifest
from builder.quality.gate import run_quality_gate
from builder.quality.metrics import QualityThresholds
from builder.quantize import QuantizeOptions, quantize_checkpoint
from builder.spec.build_spec import BuildSpec
from builder.spec.torch_gpu import build_check_device, is_gpu_engine
from triton_backend.engine.config import WEIGHTS_FILE, EngineConfig
from triton_backend.engine.weights import TORCH_DTYPES

class BuildSteps:
    """Numbered, timed build steps on the console."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        self.total, self.index = total, 0
        self.console = console or Console(stderr=True)

    @contextmanager
    def step(self, title: str) -> Iterator[Callable[[str], None]]:
        self.index += 1
        self.console.print(f"[bold cyan][{self.index}/{self.total}][/] {title}")
        start = time.perf_counter()
        yield lambda message: self.console.print(f"      {message}")
        self.console.print(f"      [green]done[/] in {time.perf_counter() - start:.1f}s")


def _step_count(spec: BuildSpec) -> int:
    quantized = spec.quantization.weights != "none" or spec.quantization.kv_cache != "none"
    return {"torch": 5 + (spec.lora is not None), "naive": 2,
            "trtllm": 4 + quantized + (spec.lora is not None)}[spec.target]


def _resolve(spec: BuildSpec, steps: BuildSteps) -> tuple[Path, EngineConfig]:
    with steps.step(f"checkpoint {spec.checkpoint}") as log:
        hf_dir = resolve_checkpoint(spec.checkpoint, log)
        config = engine_config_for(spec, hf_dir, convert.read_hf_config(hf_dir))
        m = config.model
        log(f"{m.architecture}: {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
            f"heads {m.num_attention_heads}/{m.num_key_value_heads} (q/kv), vocab {m.vocab_size}")
    return hf_dir, config


def trtllm_command(spec: BuildSpec, console: Console | None = None) -> str:
    """`forge engine --dry-run`: the trtllm-build command `spec` would run; nothing is written."""
    from builder.trtllm.engine import plan_engine

    if spec.target != "trtllm":
        raise ValueError(f"target: --dry-run prints the trtllm-build command of target trtllm, "
                         f"got {spec.target!r}")
    _, config = _resolve(spec, BuildSteps(total=1, console=console))
    return plan_engine(spec, config).shell_command()


def build_engine(spec: BuildSpec, console: Console | None = None, emit_repository: bool = True,
                 repository_dir: Path | None = None, build_key=None,
                 keep_rejected: bool = False) -> Path:
    """Build `spec` into its engine directory and (unless told not to) its Triton repository at
    `repository_dir` (default model_repository/<name>); returns the engine directory.
    `build_key` (a builder.pipeline.build_key.BuildKey) is saved into the engine once it is complete.
    `keep_rejected` (torch target): an engine its quality gate rejects is kept whole in
    `<output>.rejected/`, not only its report."""
    check_replaceable(spec.output_dir)  # before any long work
    steps = BuildSteps(total=_step_count(spec) + emit_repository, console=console)
    hf_dir, config = _resolve(spec, steps)
    if spec.target == "naive":
        from builder.pipeline.naive import build_naive_engine

        with steps.step("naive engine: the checkpoint as is, for transformers generate") as log:
            engine_dir = build_naive_engine(spec, hf_dir, spec.output_dir, log)
    elif spec.target == "trtllm":
        from builder.trtllm.engine import build_trtllm_engine, plan_engine

        plan = plan_engine(spec, config)  # sizing errors before any long work
        engine_dir = build_trtllm_engine(spec, config, hf_dir, steps, plan)
    else:
        engine_dir = _build_torch_engine(spec, config, hf_dir, steps, keep_rejected)
    if build_key is not None:
        build_key.save(engine_dir)
    if emit_repository:
        with steps.step("Triton model repository") as log:
            target = repository_dir or Path("model_repository") / spec.name
            log(f"written to {emit_repository_for(spec, engine_dir, target)}")
    return engine_dir


def _build_torch_engine(spec: BuildSpec, config: EngineConfig, hf_dir: Path,
                        steps: BuildSteps, keep_rejected: bool = False) -> Path:
    engine_dir = spec.output_dir
    check_replaceable(engine_dir)
    tmp_dir = staging_dir(engine_dir)
    try:
        _stage_torch_engine(spec, config, hf_dir, steps, tmp_dir, engine_dir)
    except QualityGateError as exc:  # rejected: the previous engine stays, the report is kept
        kept = keep_rejected_build(tmp_dir, engine_dir, whole=keep_rejected)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise QualityGateError(f"{exc} ({rejected_note(kept, keep_rejected)})" if kept
                               else str(exc)) from None
    except BaseException:  # a failed build leaves the previous engine as it was
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    swap_in(tmp_dir, engine_dir)
    return engine_dir


def _stage_torch_engine(spec: BuildSpec, config: EngineConfig, hf_dir: Path, steps: BuildSteps,
                        tmp_dir: Path, engine_dir: Path) -> None:
    """Write and check the engine in `tmp_dir` (to become `engine_dir`): weights, tokenizer,
    config, manifest, then the kernels and the quality gate (or the logits check), all before
    it is swapped in."""
    options = QuantizeOptions.from_spec(spec.quantization)
    if options.enabled:
        with steps.step(f"quantize: weights {options.weights}, KV cache {options.kv_cache} "
                        f"(calibration, TensorRT-LLM checkpoint, runtime weights)") as log:
            result = quantize_checkpoint(hf_dir, tmp_dir, options, TORCH_DTYPES[spec.dtype],
                                         progress=log, config=config)
            result.apply(config)
            config.quantization.lm_head = options.lm_head
            log(f"{(tmp_dir / WEIGHTS_FILE).stat().st_size / 2**20:.0f} MiB of runtime weights")
    else:
        with steps.step(f"weights -> {spec.dtype}, fused QKV and gate/up") as log:
            state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), config.model,
                                               TORCH_DTYPES[spec.dtype])
            save_file(state, str(tmp_dir / WEIGHTS_FILE), metadata={"format": "pt"})
            log(f"{sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters, "
                f"{(tmp_dir / WEIGHTS_FILE).stat().st_size / 2**20:.0f} MiB")
    if spec.lora is not None:
        from builder.pipeline.lora import adapter_dtype, write_adapters

        with steps.step(f"LoRA adapters: {len(spec.lora.adapters)} checked against the base, "
                        f"{adapter_dtype(spec.dtype)}, fused QKV and gate/up") as log:
            config.lora = write_adapters(spec.lora, None, config.model, spec.dtype, tmp_dir, log)
    with steps.step("tokenizer, config.json, manifest.json") as log:
        copy_tokenizer(hf_dir, tmp_dir)
        if config.speculative.mode == "draft_model":
            from builder.pipeline.speculative import check_draft_engine

            log(check_draft_engine(config, tmp_dir, engine_dir))
        config.save(tmp_dir)
        write_manifest(tmp_dir, spec, hf_dir)
        log(f"eos ids {config.tokenizer.eos_token_ids}, chat template: "
            f"{config.tokenizer.has_chat_template}")
    if is_gpu_engine(config.hardware):
        with steps.step("CPU kernels: skipped") as log:
            log(f"a GPU engine (hardware {config.hardware}) runs the GPU ops, not the CPU kernels")
    else:
        with steps.step("CPU kernels (compiled once, cached)") as log:
            prepare_cpu_kernels(config, log)
    thresholds = QualityThresholds.from_spec(spec.quantization.quality)
    if (options.enabled or options.lm_head != "none") and not thresholds.enabled:
        with steps.step("quality gate: off (quantization.quality.enabled: false)") as log:
            log("this engine's quantization is not checked against the checkpoint and it has "
                "no quality.json; `forge check --engine DIR` runs the gate on it")
    elif options.enabled or options.lm_head != "none":
        with steps.step("quality gate: quantized engine vs the unquantized checkpoint") as log:
            run_quality_gate(tmp_dir, hf_dir, thresholds, progress=log, echo=log)
    else:
        with steps.step("check: prefill logits vs transformers") as log:
            log(check_against_transformers(tmp_dir, hf_dir))


def prepare_cpu_kernels(config: EngineConfig, log: Callable[[str], None]) -> None:
    """Build (or load) the runtime's C++ kernels now, so the first server start does not wait,
    and say which bf16 GEMM this CPU will use."""
    from triton_backend.engine.cpu.kernels import load_cpu_kernels, plan_key

    if not load_cpu_kernels(log):
        return
    if config.dtype != "float32":
        from triton_backend.engine.cpu.linear import bf16_gemm_plan

        plan = bf16_gemm_plan(plan_key())
        if not plan.packed:
            log("bf16 projections: torch's bf16 GEMM")
            return
        kernel = {"amx": "AMX tiles", "pairs": "bf16 dot products (AVX-512 BF16)",
                  "tiles": "weights widened to fp32 in registers"}[plan.layout]
        if plan.measured_in is not None:
            log(f"bf16 projections: per weight shape, the packed bf16 kernel ({kernel}) where it "
                f"beats torch's bf16 GEMM on this CPU (measured at the first load of each shape)")
            return
        widened = (f"; from {plan.upcast_min_rows} tokens on, widened to fp32 for torch's fp32 "
                   f"GEMM" if plan.upcast_min_rows else "")
        log(f"bf16 projections: the packed bf16 kernel, {kernel}{widened}")


def keep_rejected_build(staged: Path, engine_dir: Path, whole: bool = False) -> Path | None:
    """A rejected build's report, or with `whole` the rejected engine itself, in
    `<engine_dir>.rejected/` (replacing what an earlier rejection left there), so CI can archive
    it and a user can check or try it; its path, or None when the gate wrote no report."""
    from builder.quality.gate import QUALITY_FILE

    source = staged / QUALITY_FILE
    if not source.is_file():
        return None
    target_dir = engine_dir.with_name(engine_dir.name + ".rejected")
    if target_dir.exists():
        if not (target_dir / QUALITY_FILE).is_file() and any(target_dir.iterdir()):
            raise ValueError(f"{target_dir}: not a rejected build's directory; not replaced")
        shutil.rmtree(target_dir)
    if whole:
        shutil.move(str(staged), target_dir)
        return target_dir
    target_dir.mkdir(parents=True)
    shutil.move(str(source), target_dir / QUALITY_FILE)
    return target_dir / QUALITY_FILE


def rejected_note(kept: Path, whole: bool) -> str:
    """Where a rejected build went and what can be done with it."""
    if whole:
        return (f"rejected engine kept: {kept}; `forge check --engine {kept}` measures it "
                f"again, `forge generate --engine {kept}` tries it")
    return f"report: {kept}; --keep-rejected keeps the whole engine to check or try"


def emit_repository_for(spec: BuildSpec, engine_dir: Path, output: Path) -> Path:
    from builder.repository.emit import RepositoryOptions, emit_repository

    return emit_repository(engine_dir, output, RepositoryOptions.from_dict(spec.repository),
                           spec.serving)


def check_against_transformers(engine_dir: Path, hf_dir: Path) -> str:
    """A quick build-time check: the engine's prefill logits vs transformers' at the same dtype,
    both on the device `build_check_device` picks (a GPU engine on a CPU machine: the CPU)."""
    from transformers import AutoModelForCausalLM

    from triton_backend.engine.offline import prefill_logits
    from triton_backend.engine.tokenizer import load_tokenizer
    from triton_backend.engine.weights import runtime_dtype

    config = EngineConfig.load(engine_dir)
    device = torch.device(build_check_device(config.hardware))
    tokenizer = load_tokenizer(engine_dir, config)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    ours = prefill_logits(engine_dir, ids, device=str(device)).float()
    dtype = runtime_dtype(config, device)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids], device=device)).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    where = (f"on {device}" if device.type == "cuda" or not is_gpu_engine(config.hardware)
             else "on the CPU, no GPU visible")
    return (f"max |logit diff| {diff:.3g} ({str(dtype).removeprefix('torch.')} {where}), "
            f"top-1 agreement {agree:.0%} over {len(ids)} positions")

"""The `trtllm-build` command of a trtllm engine, written out in full, and running it.

Every flag is explicit (none left to TensorRT-LLM's defaults, which change between releases), and
every name and value is one `trtllm-build` of the pinned TensorRT-LLM 1.2 line accepts
(`tensorrt_llm/commands/build.py` and the plugin flags of `tensorrt_llm/plugin/plugin.py`; the
test data in tests/data/trtllm_build_flags.json names the source). The plugin choices mirror the
rules `tensorrt_llm/builder.py` applies at build time, so the command says what the engine will be
instead of TensorRT-LLM silently switching a feature off:
- FP8 context FMHA only with FP8 weights (the FP8 workflow) on SM >= 89;
- paged context FMHA (what KV-cache reuse and chunked context need) is off with an INT8 KV cache,
  and with an FP8 KV cache unless FP8 context FMHA is on.
`--kv_cache_type paged` is the 1.2 spelling of the paged KV cache (`--paged_kv_cache` is marked
deprecated there).
"""
from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from builder.spec.hardware import HardwareProfile
from builder.trtllm.lora import TrtllmLora
from triton_backend.engine.config import Limits

CHECKPOINT_SUBDIR = "trtllm_checkpoint"
ENGINE_SUBDIR = "trtllm_engine"
BUILD_SCRIPT = "build.sh"
BUILD_LOG = "build.log"
PINNED_TRTLLM = "1.2"  # the release line with trtllm-build and plugins


def _switch(on: bool) -> str:
    return "enable" if on else "disable"


@dataclass(frozen=True)
class TrtllmBuildPlan:
    """What `trtllm-build` builds: paths relative to the engine directory."""

    dtype: str
    limits: Limits
    tokens_per_block: int
    weights: str
    kv_cache: str
    profile: HardwareProfile
    lora: TrtllmLora | None = None  # the LoRA plugin and adapters (builder/trtllm/lora.py)
    moe: bool = False  # a mixture-of-experts model: its layers run TensorRT-LLM's MoE plugin

    @property
    def fp8_context_fmha(self) -> bool:
        return self.weights == "fp8" and self.profile.fp8

    @property
    def paged_context_fmha(self) -> bool:
        if self.kv_cache == "int8":
            return False
        return self.kv_cache != "fp8" or self.fp8_context_fmha

    def plugins(self) -> dict[str, str]:
        """Plugin and feature flags, named as trtllm-build names them."""
        return {
            "gpt_attention_plugin": self.dtype,
            # The dtype spelled out (what `auto` resolves to); quantized GEMMs take their own
            # plugins (INT4 weight-only groupwise) or TensorRT's FP8 kernels.
            "gemm_plugin": self.dtype,
            "context_fmha": "enable",
            "remove_input_padding": "enable",
            "tokens_per_block": str(self.tokens_per_block),
            "use_paged_context_fmha": _switch(self.paged_context_fmha),
            "use_fp8_context_fmha": _switch(self.fp8_context_fmha),
            "multiple_profiles": "enable",
            # The experts' grouped GEMMs (moe_plugin, on by default as `auto`), spelled out.
            **({"moe_plugin": self.dtype} if self.moe else {}),
        }

    def arguments(self) -> list[str]:
        limits = self.limits
        args = ["--checkpoint_dir", CHECKPOINT_SUBDIR, "--output_dir", ENGINE_SUBDIR,
                "--max_batch_size", str(limits.max_batch_size),
                "--max_input_len", str(limits.max_input_len),
                "--max_seq_len", str(limits.max_seq_len),
                "--max_num_tokens", str(limits.max_num_tokens),
                "--max_beam_width", "1",
                "--kv_cache_type", "paged",
                # One rank at a time on GPU 0..: the build host may have fewer GPUs than ranks.
                "--workers", "1",
                "--log_level", "info"]
        for name, value in self.plugins().items():
            args += [f"--{name}", value]
        if self.lora is not None:
            args += self.lora.arguments()
        return args

    def command(self) -> list[str]:
        return ["trtllm-build", *self.arguments()]

    def shell_command(self) -> str:
        """The command as one shell line (run from the engine directory)."""
        return " ".join(shlex.quote(part) for part in self.command())


def write_build_script(engine_dir: Path, plan: TrtllmBuildPlan, header: str) -> Path:
    """`build.sh`: the exact command, runnable from anywhere on a host with TensorRT-LLM 1.2.x."""
    lines = ["#!/usr/bin/env bash", *(f"# {line}" for line in header.splitlines()),
             "set -euo pipefail", 'cd "$(dirname "$0")"',
             f"rm -rf {ENGINE_SUBDIR}",
             " \\\n    ".join(_argument_lines(plan)) + f" 2>&1 | tee {BUILD_LOG}", ""]
    path = engine_dir / BUILD_SCRIPT
    path.write_text("\n".join(lines))
    path.chmod(0o755)
    return path


def _argument_lines(plan: TrtllmBuildPlan) -> list[str]:
    """One "--flag value..." per line (--lora_dir and --lora_target_modules take several)."""
    lines = [plan.command()[0]]
    for part in plan.command()[1:]:
        if part.startswith("--"):
            lines.append(part)
        else:
            lines[-1] += f" {shlex.quote(part)}"
    return lines


def trtllm_available() -> str | None:
    """Why trtllm-build cannot run here (None when it can)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "tensorrt_llm does not import here (no TensorRT-LLM installed)"
    if shutil.which("trtllm-build") is None:
        return "tensorrt_llm is installed but trtllm-build is not on PATH"
    return None


def run_build(engine_dir: Path, plan: TrtllmBuildPlan, log: Callable[[str], None]) -> Path:
    """Run trtllm-build in `engine_dir`, its output kept in build.log; returns the engine subdir.

    Raises RuntimeError with the log's tail when the build fails.
    """
    shutil.rmtree(engine_dir / ENGINE_SUBDIR, ignore_errors=True)
    log_path = engine_dir / BUILD_LOG
    with open(log_path, "w") as sink:
        process = subprocess.Popen(plan.command(), cwd=engine_dir, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            sink.write(line)
            if "[TRT-LLM]" in line and ("[I] Total time" in line or "Engine" in line):
                log(line.strip())  # progress: the milestones, the rest is in build.log
        code = process.wait()
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"trtllm-build failed with exit code {code} (log: {log_path}):\n{tail}")
    return engine_dir / ENGINE_SUBDIR

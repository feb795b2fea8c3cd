"""A GPU engine of the torch target prepared on a machine without a GPU: `forge engine` builds it
and checks it on the CPU, its repository gives the tensorrt_llm model a GPU instance, `forge serve`
and `forge generate` refuse it here with one line, and `forge generate --device cpu` runs it."""
from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import tiny
from builder.pipeline import convert
from builder.cli import main
from builder.pipeline.engine_builder import build_engine
from builder.pipeline.engine_files import engine_config_for
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.spec.load import spec_from_dict
from triton_backend.engine.config import EngineConfig

pytestmark = pytest.mark.slow
LIMITS = {"max_batch_size": 8, "max_num_tokens": 128, "max_input_len": 64, "max_seq_len": 128}


def _build(tmp: Path, checkpoint: Path, name: str, **spec) -> tuple[Path, str]:
    """(engine dir, the build's console output); a repository beside the engine."""
    out = io.StringIO()
    data = {"name": name, "checkpoint": str(checkpoint), "output": str(tmp / "engines" / name),
            "limits": LIMITS, "kv_cache": {"tokens_per_block": 8}, **spec}
    engine = build_engine(spec_from_dict(data), console=Console(file=out, width=300),
                          repository_dir=tmp / "repos" / name)
    return engine, out.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: (engine dir, console output)}: an h100-80gb engine in the default dtype, and a
    float32 one for the GPU and for the CPU from the same checkpoint."""
    tmp = tmp_path_factory.mktemp("gpu")
    checkpoint = tiny.make_checkpoint(tmp / "hf", "llama_gqa")
    return {"gpu": _build(tmp, checkpoint, "gpu", hardware="h100-80gb"),
            "gpu32": _build(tmp, checkpoint, "gpu32", hardware="h100-80gb", dtype="float32"),
            "cpu32": _build(tmp, checkpoint, "cpu32", dtype="float32"),
            "checkpoint": (checkpoint, "")}


def _params(config_pbtxt: str) -> dict[str, str]:
    return dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config_pbtxt))


def _kind(repo: Path, model: str) -> str:
    text = (repo / model / "config.pbtxt").read_text()
    return re.search(r"instance_group \[ \{ count: \d+ kind: (\w+) \} \]", text).group(1)


def test_the_build_skips_the_cpu_kernels_and_checks_on_the_cpu(built):
    engine, output = built["gpu"]
    assert "CPU kernels: skipped" in output
    assert "a GPU engine (hardware h100-80gb) runs the GPU ops, not the CPU kernels" in output
    assert re.search(r"max \|logit diff\| \S+ \(bfloat16 on the CPU, no GPU visible\), top-1 "
                     r"agreement", output), output
    config = json.loads((engine / "config.json").read_text())
    assert config["hardware"] == "h100-80gb" and config["dtype"] == "bfloat16"
    assert config["kv_cache"]["free_gpu_mem_fraction"] == 0.9  # the profile's
    assert config["limits"]["max_seq_len"] == 128  # given limits stand (they fit an H100)
    assert config["extra"]["gpu"]["sm"] == 90 and config["extra"]["gpu"]["memory"]["kv_tokens"] > 0
    cpu_output = built["cpu32"][1]
    assert "CPU kernels (compiled once, cached)" in cpu_output and "(float32 on cpu)" in cpu_output


def test_the_repository_gives_tensorrt_llm_a_gpu_instance_and_the_rest_cpu(built):
    engine, _ = built["gpu"]
    repo = engine.parent.parent / "repos" / "gpu"
    assert _kind(repo, "tensorrt_llm") == "KIND_GPU"
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert _kind(repo, model) == "KIND_CPU"
    params = _params((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9" and params["gpu_device_ids"] == ""
    cpu_repo = built["cpu32"][0].parent.parent / "repos" / "cpu32"
    assert _kind(cpu_repo, "tensorrt_llm") == "KIND_CPU"
    assert _params((cpu_repo / "tensorrt_llm" / "config.pbtxt").read_text())[
        "kv_cache_free_gpu_mem_fraction"] == ""


def test_kind_model_takes_its_devices_from_gpu_device_ids(built, tmp_path):
    engine, _ = built["gpu"]
    repo = emit_repository(engine, tmp_path / "repo", RepositoryOptions(
        tensorrt_llm_instance_kind="model", gpu_device_ids="1;0", tensorrt_llm_instance_count=2,
        kv_cache_free_gpu_mem_fraction=0.5))
    text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 2 kind: KIND_MODEL } ]" in text
    params = _params(text)
    assert params["gpu_device_ids"] == "1;0" and params["kv_cache_free_gpu_mem_fraction"] == "0.5"
    with pytest.raises(ValueError, match="repository.tensorrt_llm_instance_kind: 'gpu' places a "
                                         "GPU engine; this engine's hardware is cpu"):
        emit_repository(built["cpu32"][0], tmp_path / "cpu-repo",
                        RepositoryOptions(tensorrt_llm_instance_kind="gpu"))


def test_a_repository_fraction_becomes_the_engines_and_limits_are_sized(built):
    checkpoint, _ = built["checkpoint"]
    spec = spec_from_dict({"name": "f", "checkpoint": str(checkpoint), "hardware": "l4",
                           "repository": {"kv_cache_free_gpu_mem_fraction": 0.8}})
    config = engine_config_for(spec, checkpoint, convert.read_hf_config(checkpoint))
    assert config.kv_cache.free_gpu_mem_fraction == 0.8 and config.hardware == "l4"
    assert config.limits.max_seq_len == 256  # the tiny model's context, as sized for trtllm
    assert config.limits.max_batch_size == 256 and config.limits.max_num_tokens == 8192


def _forge(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder.cli", *args], capture_output=True,
                          text=True, timeout=180, **kwargs)


def _no_gpu(engine: Path) -> str:
    import torch

    return (f"error: engine {engine.resolve()} (hardware h100-80gb) runs on a CUDA GPU and no "
            f"CUDA device is visible here (torch {torch.__version__}, CUDA not built in)")


def test_forge_serve_refuses_before_opening_a_port(built):
    """The health port is held by someone else: had forge serve opened its ports first, it would
    name that port; it names the missing GPU instead."""
    engine, _ = built["gpu"]
    repo = engine.parent.parent / "repos" / "gpu"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _forge("serve", "--repository", str(repo), "--health-port", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"{_no_gpu(engine)}: serve it on a GPU host (or build it for "
                             f"hardware cpu)\n")
    assert result.stdout == ""


def test_forge_generate_refuses_and_runs_on_the_cpu_when_told(built):
    engine, _ = built["gpu"]
    result = _forge("generate", "--engine", str(engine), "--prompt-ids", "5,6,7")
    assert result.returncode == 2
    assert result.stderr == f"{_no_gpu(engine)}: --device cpu runs it on the CPU\n"
    result = _forge("generate", "--engine", str(engine), "--prompt-ids", "5,6,7", "--device", "cuda:1")
    assert result.returncode == 2 and "device cuda:1: the engine (hardware h100-80gb) runs on a " \
        "CUDA GPU and none is visible" in result.stderr


def test_generate_on_the_cpu_gives_the_gpu_engine_the_cpu_engines_tokens(built):
    def tokens(engine: Path, *extra: str) -> list[int]:
        result = CliRunner().invoke(main, ["generate", "--engine", str(engine), "--prompt-ids",
                                           "5,6,7,8,9", "--max-tokens", "12", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["output_ids"]

    gpu, cpu = built["gpu32"][0], built["cpu32"][0]
    assert EngineConfig.load(gpu).hardware == "h100-80gb"
    expected = tokens(cpu)
    assert len(expected) == 12
    assert tokens(gpu, "--device", "cpu") == expected
    assert tokens(cpu, "--device", "cpu") == expected


def test_a_quantized_gpu_build_passes_its_gate_on_the_cpu(tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is the quant extra")
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: gpu-int4\ncheckpoint: {checkpoint}\nhardware: h100-80gb\n"
        f"output: {tmp_path / 'engine'}\n"
        "limits: {max_batch_size: 4, max_num_tokens: 64, max_input_len: 64, max_seq_len: 128}\n"
        "quantization:\n  weights: int4_rtn\n  group_size: 32\n"
        "  calibration: {samples: 2, seq_len: 32}\n"
        "  quality: {max_perplexity_increase_pct: 10, min_top1_agreement: null,\n"
        "            min_logit_cosine: 0.8, windows: 2, seq_len: 32, prompts: 1,\n"
        "            greedy_tokens: 2}\n")
    result = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository"])
    assert result.exit_code == 0, result.output
    assert "quality gate: passed" in result.output
    config = EngineConfig.load(tmp_path / "engine")
    assert config.quantization.weights == "int4_rtn" and config.hardware == "h100-80gb"

"""The trtllm target: hardware profiles, the trtllm-build command against the pinned flag table,
forbidden combinations failing at spec load, and a build that stops after the checkpoint here."""
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

import tiny
from builder.cli import main
from builder.pipeline.engine_builder import build_engine, trtllm_command
from builder.spec.hardware import GPU_PROFILES, PROFILES, memory_plan, sized_limits
from builder.spec.build_spec import SpecError
from builder.spec.load import spec_from_dict
from triton_backend.engine.config import EngineConfig, Limits, ModelShape

FLAGS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_build_flags.json").read_text())
REQUIRED = ("--checkpoint_dir", "--output_dir", "--gpt_attention_plugin", "--gemm_plugin",
            "--context_fmha", "--remove_input_padding", "--kv_cache_type", "--tokens_per_block",
            "--use_paged_context_fmha", "--use_fp8_context_fmha", "--max_batch_size",
            "--max_input_len", "--max_seq_len", "--max_num_tokens", "--multiple_profiles")
LLAMA_8B = ModelShape(architecture="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_checkpoint(tmp_path_factory.mktemp("trt") / "hf", "llama_gqa")


def trt_spec(checkpoint, tmp_path=None, **patch):
    data = {"name": "t", "checkpoint": str(checkpoint), "target": "trtllm", "hardware": "l4",
            "dtype": "bfloat16", "kv_cache": {"tokens_per_block": 32}}
    if tmp_path is not None:
        data["output"] = str(tmp_path / "engine")
    data.update(patch)
    return spec_from_dict(data)


def parse_flags(command: str) -> dict[str, str]:
    parts = shlex.split(command)
    assert parts[0] == "trtllm-build"
    flags = {}
    for name, value in zip(parts[1::2], parts[2::2]):
        assert name.startswith("--") and name not in flags, name
        flags[name] = value
    return flags


CASES = [(hw, q) for hw in GPU_PROFILES for q in ("none", "int4_awq", "fp8")
         if q != "fp8" or PROFILES[hw].fp8]


@pytest.mark.parametrize("hardware, weights", CASES)
def test_dry_run_command_uses_only_pinned_flags_and_values(checkpoint, hardware, weights):
    spec = trt_spec(checkpoint, hardware=hardware, quantization={"weights": weights})
    flags = parse_flags(trtllm_command(spec))
    for name, value in flags.items():
        allowed = FLAGS["flags"].get(name)
        assert allowed is not None, f"{name} is not a trtllm-build flag of the pinned release"
        assert not allowed.get("deprecated"), f"{name} is deprecated in the pinned release"
        if "choices" in allowed:
            assert value in allowed["choices"], (name, value)
        elif allowed["type"] == "int":
            assert int(value) >= 1, (name, value)
    assert set(REQUIRED) <= set(flags)
    assert flags["--gpt_attention_plugin"] == "bfloat16" and flags["--gemm_plugin"] == "bfloat16"
    assert flags["--use_fp8_context_fmha"] == ("enable" if weights == "fp8" else "disable")
    assert flags["--use_paged_context_fmha"] == "enable"
    assert flags["--tokens_per_block"] == "32"


def test_kv_cache_quantization_switches_paged_context_as_tensorrt_llm_does(checkpoint):
    int8 = parse_flags(trtllm_command(trt_spec(checkpoint, quantization={"kv_cache": "int8"})))
    assert int8["--use_paged_context_fmha"] == "disable"
    fp8_kv = trt_spec(checkpoint, hardware="h100-80gb", quantization={"kv_cache": "fp8"})
    assert parse_flags(trtllm_command(fp8_kv))["--use_paged_context_fmha"] == "disable"
    both = trt_spec(checkpoint, hardware="h100-80gb",
                    quantization={"weights": "fp8", "kv_cache": "fp8"})
    flags = parse_flags(trtllm_command(both))
    assert flags["--use_paged_context_fmha"] == "enable" == flags["--use_fp8_context_fmha"]


@pytest.mark.parametrize("patch, message", [
    ({"hardware": "a100-40gb", "quantization": {"weights": "fp8"}},
     "quantization.weights: fp8 needs FP8 tensor cores (SM >= 89: l4, h100-80gb); a100-40gb is SM 80"),
    ({"hardware": "a100-80gb", "quantization": {"kv_cache": "fp8"}}, "quantization.kv_cache: fp8"),
    ({"hardware": "cpu"}, "hardware: target trtllm needs a GPU profile"),
    ({"dtype": "float32"}, "dtype: target trtllm builds ['bfloat16', 'float16'] engines"),
    ({"hardware": "v100"}, "hardware: must be one of"),
    ({"parallelism": {"tp": 0}}, "parallelism.tp: must be an integer >= 1, got 0"),
    ({"parallelism": {"dp": 2}}, "parallelism.dp: unknown key"),
    ({"repository": {"tensorrt_llm_backend": "onnx"}}, "repository.tensorrt_llm_backend must be"),
    ({"repository": {"kv_cache_free_gpu_mem_fraction": 1.5}},
     "repository.kv_cache_free_gpu_mem_fraction must be in (0, 1)"),
    ({"target": "torch", "hardware": "l4", "parallelism": {"tp": 2}},
     "parallelism: tp/pp are TensorRT-LLM's (target trtllm); target torch runs on one GPU"),
    ({"target": "naive", "hardware": "l4"}, "hardware: target naive runs on the CPU"),
    ({"target": "torch", "hardware": "cpu", "parallelism": {"tp": 2}}, "parallelism: tp/pp"),
    ({"target": "torch", "hardware": "cpu", "repository": {"tensorrt_llm_backend": "tensorrtllm"}},
     "repository.tensorrt_llm_backend: 'tensorrtllm' (NVIDIA's C++ backend) serves trtllm"),
])
def test_forbidden_combinations_fail_at_spec_load(checkpoint, patch, message):
    with pytest.raises(SpecError) as err:
        trt_spec(checkpoint, **patch)
    assert message in str(err.value)


def test_profiles_size_limits_and_refuse_a_sequence_that_does_not_fit():
    plan = memory_plan(LLAMA_8B, PROFILES["l4"])  # bf16: 16 GB of weights on a 24 GiB L4
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    with pytest.raises(ValueError, match=r"limits.max_seq_len \(131072\) does not fit the KV cache "
                                         r"on l4: .* tokens \(131072 bytes each\)"):
        sized_limits(LLAMA_8B, PROFILES["l4"], plan, 32, Limits(max_input_len=4096,
                                                                max_seq_len=131072))
    sized = sized_limits(LLAMA_8B, PROFILES["h100-80gb"],
                         memory_plan(LLAMA_8B, PROFILES["h100-80gb"]), 32)
    assert sized.max_seq_len == 8192 and sized.max_input_len == 4096
    assert sized.max_batch_size & (sized.max_batch_size - 1) == 0  # a power of two
    assert sized.max_num_tokens == 8192
    int4 = memory_plan(LLAMA_8B, PROFILES["l4"], weights="int4_awq", kv_cache="fp8")
    assert int4.kv_tokens > 4 * plan.kv_tokens
    with pytest.raises(ValueError, match="leave no memory for the KV cache"):
        memory_plan_70b = memory_plan(ModelShape(**{**LLAMA_8B.__dict__, "num_hidden_layers": 160}),
                                      PROFILES["l4"])
        sized_limits(LLAMA_8B, PROFILES["l4"], memory_plan_70b, 32)


def test_parallelism_must_split_the_model(checkpoint):
    with pytest.raises(ValueError, match=r"parallelism.tp \(3\) must divide the model's 4"):
        trtllm_command(trt_spec(checkpoint, parallelism={"tp": 3}))
    with pytest.raises(ValueError, match=r"parallelism.pp \(5\) exceeds the model's 2 layers"):
        trtllm_command(trt_spec(checkpoint, parallelism={"pp": 5}))


def test_cli_dry_run_prints_the_command_and_writes_nothing(checkpoint, tmp_path):
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["engine", "--checkpoint", str(checkpoint), "--target",
                                       "trtllm", "--hardware", "a100-80gb", "--dtype", "float16",
                                       "--output", str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    flags = parse_flags(result.output.strip().splitlines()[-1])
    assert flags["--gemm_plugin"] == "float16" and not out.exists()
    bad = CliRunner().invoke(main, ["engine", "--checkpoint", str(checkpoint), "--target",
                                    "trtllm", "--hardware", "a100-40gb", "--quantization", "fp8",
                                    "--dry-run"])
    assert bad.exit_code == 2 and "quantization.weights: fp8 needs FP8 tensor cores" in bad.output
    head = CliRunner().invoke(main, ["engine", "--checkpoint", str(checkpoint), "--target",
                                     "trtllm", "--hardware", "a100-80gb", "--lm-head", "int8",
                                     "--dry-run"])
    assert head.exit_code == 2
    assert "quantization.lm_head: 'int8' runs on the torch target's CPU kernels" in head.output


def test_build_stops_after_the_checkpoint_without_tensorrt_llm(checkpoint, tmp_path):
    from rich.console import Console

    spec = trt_spec(checkpoint, tmp_path, parallelism={"tp": 2},
                    limits={"max_batch_size": 8, "max_num_tokens": 128, "max_input_len": 64,
                            "max_seq_len": 128})
    engine = build_engine(spec, console=Console(quiet=True), emit_repository=False)
    ckpt = json.loads((engine / "trtllm_checkpoint" / "config.json").read_text())
    assert ckpt["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert ckpt["dtype"] == "bfloat16" and ckpt["quantization"]["quant_algo"] is None
    assert {p.name for p in (engine / "trtllm_checkpoint").glob("rank*.safetensors")} == \
        {"rank0.safetensors", "rank1.safetensors"}
    script = (engine / "build.sh").read_text()
    config = EngineConfig.load(engine)
    assert config.target == "trtllm" and config.extra["trtllm"]["tp"] == 2
    assert parse_flags(config.extra["trtllm"]["command"])["--max_seq_len"] == "128"
    assert "trtllm-build" in script and "--max_batch_size 8" in script
    assert not (engine / "trtllm_engine").exists()
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["toolchain"]["tensorrt_llm"] is None  # nothing built it here

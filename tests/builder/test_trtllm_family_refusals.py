"""What the trtllm target cannot build for the new families is refused before any work (spec load
for the parallelism section, the plan, --dry-run included, for what needs the model), each with
its exact message naming the field; the dry run shows the MoE plugin."""
import dataclasses
import shlex
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

import tiny
from builder.cli import main
from builder.pipeline.engine_builder import trtllm_command
from builder.spec.build_spec import ParallelismSpec, QuantizationSpec, SpecError
from builder.spec.load import spec_from_dict
from builder.trtllm.families import check_buildable
from triton_backend.engine.config import ModelShape


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    return {name: tiny.make_checkpoint(root / name, shape) for name, shape in
            [("gemma3", "family:gemma3"), ("mixtral", "family:mixtral"),
             ("qwen3_moe", "family:qwen3_moe"), ("llama", "llama_gqa")]}


def trt_spec(checkpoint, **patch):
    return spec_from_dict({"name": "t", "checkpoint": str(checkpoint), "target": "trtllm",
                           "hardware": "l4", "dtype": "bfloat16", **patch})


@pytest.mark.parametrize("parallelism, message", [
    ({"tp": 2, "moe_tp": 2, "moe_ep": 2}, "parallelism: moe_tp * moe_ep must equal tp, got 2 * 2 != 2"),
    ({"tp": 2, "moe_ep": 3}, "parallelism.moe_ep (3) must divide parallelism.tp (2): moe_tp * moe_ep == tp"),
    ({"tp": 4, "moe_tp": 3}, "parallelism.moe_tp (3) must divide parallelism.tp (4): moe_tp * moe_ep == tp"),
    ({"moe_ep": 0}, "parallelism.moe_ep: must be an integer >= 1, got 0"),
    ({"moe_tp": "2"}, "parallelism.moe_tp: must be an integer >= 1, got '2'"),
])
def test_expert_parallelism_is_checked_at_spec_load(checkpoints, parallelism, message):
    with pytest.raises(SpecError) as err:
        trt_spec(checkpoints["mixtral"], parallelism=parallelism)
    assert str(err.value) == message


def test_expert_split_resolves_like_tensorrt_llm_mapping():
    assert ParallelismSpec(tp=4).moe_split == (4, 1)  # mapping.py: unset -> moe_tp = tp
    assert ParallelismSpec(tp=4, moe_ep=4).moe_split == (1, 4)
    assert ParallelismSpec(tp=4, moe_tp=2).moe_split == (2, 2)


def test_the_torch_target_refuses_expert_parallelism(checkpoints):
    with pytest.raises(SpecError, match=r"^parallelism: tp/pp are TensorRT-LLM's \(target trtllm\)"):
        spec_from_dict({"name": "t", "checkpoint": str(checkpoints["mixtral"]),
                        "parallelism": {"moe_ep": 1}})


@pytest.mark.parametrize("family, patch, message", [
    ("qwen3_moe", {},
     "checkpoint: layers [1] have a dense MLP (mlp_only_layers / decoder_sparse_step); "
     "TensorRT-LLM 1.2's Qwen3MoeForCausalLM puts experts in every layer"),
    ("gemma3", {"quantization": {"weights": "int4_awq"}},
     "quantization.weights: target trtllm writes the gemma3 checkpoint unquantized only "
     "(ModelOpt's exporter cannot export gemma3); use none, or target torch"),
    ("mixtral", {"quantization": {"kv_cache": "int8"}},
     "quantization.kv_cache: target trtllm writes the mixtral checkpoint unquantized only "
     "(ModelOpt's exporter cannot export mixtral); use none, or target torch"),
    ("llama", {"parallelism": {"moe_ep": 1}},
     "parallelism.moe_tp / moe_ep: the llama model has no experts to split"),
])
def test_what_trtllm_build_cannot_build_is_refused_before_any_work(checkpoints, family, patch,
                                                                   message):
    with pytest.raises(ValueError) as err:
        trtllm_command(trt_spec(checkpoints[family], **patch))
    assert str(err.value) == message


def shape_of(family: str, **changes) -> ModelShape:
    base = {"gemma3": dict(vocab_size=384, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=16, hidden_act="gelu_pytorch_tanh", sliding_window=24,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"]),
            "mixtral": dict(vocab_size=384, hidden_size=64, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=48)}[family]
    return ModelShape(**{"architecture": family, **base, **changes})


def plan_spec(lora=None, **parallelism):
    return SimpleNamespace(parallelism=ParallelismSpec(**parallelism),
                           quantization=QuantizationSpec(), lora=lora)


@pytest.mark.parametrize("shape, spec, message", [
    (shape_of("gemma3", architecture="gpt_oss"), plan_spec(),
     "checkpoint: target trtllm cannot build model_type gpt_oss with TensorRT-LLM 1.2's "
     "trtllm-build (its TensorRT backend has no such model); use target torch"),
    (shape_of("mixtral", num_experts=6), plan_spec(tp=4, moe_ep=4),
     "parallelism.moe_ep (4) must divide the model's 6 experts"),
    (shape_of("mixtral", moe_intermediate_size=30), plan_spec(tp=4),
     "parallelism.moe_tp (4) must divide the experts' intermediate size 30"),
    (shape_of("mixtral"), plan_spec(lora=object()),
     "lora: TensorRT-LLM's LoRA on a mixture-of-experts model (mixtral) is not wired up here; "
     "use target torch, whose adapters cover the attention"),
    (shape_of("mixtral", sliding_window=64), plan_spec(),
     "checkpoint: sliding_window 64: TensorRT-LLM 1.2's MixtralForCausalLM engine attends "
     "globally; use target torch"),
    (shape_of("gemma3", layer_types=["full_attention", "sliding_attention",
                                     "sliding_attention"]), plan_spec(),
     "checkpoint: layer_types ['full_attention', 'sliding_attention', 'sliding_attention'] is "
     "not every n-th layer global, the only interleaving TensorRT-LLM 1.2's Gemma 3 builds "
     "(_sliding_window_pattern)"),
    (shape_of("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0}), plan_spec(),
     "checkpoint: rope_scaling {'type': 'linear', 'factor': 8.0}: TensorRT-LLM 1.2's Gemma 3 "
     "would scale its local layers' rotary base too (the checkpoint scales the global ones "
     "only); use target torch"),
    (shape_of("gemma3", vocab_size=385), plan_spec(tp=2),
     "parallelism.tp (2) must divide the Gemma 3 vocabulary (385): TensorRT-LLM splits its "
     "embedding over tp"),
])
def test_model_dependent_refusals_name_the_field(shape, spec, message):
    with pytest.raises(ValueError) as err:
        check_buildable(shape, spec)
    assert str(err.value) == message


def test_every_layer_local_and_every_layer_global_are_patterns_too():
    from builder.trtllm.families import sliding_window_pattern

    local = shape_of("gemma3", layer_types=["sliding_attention"] * 3)
    assert sliding_window_pattern(local) == 4  # (i + 1) % 4 != 0 for every layer: all local
    assert sliding_window_pattern(dataclasses.replace(local, layer_types=None,
                                                      sliding_window=None)) == 1
    check_buildable(local, plan_spec())


def test_dry_run_shows_the_moe_plugin_and_the_expert_split(checkpoints, tmp_path):
    spec = tmp_path / "mixtral.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "mixtral-t", "checkpoint": str(checkpoints["mixtral"]), "target": "trtllm",
        "hardware": "h100-80gb", "dtype": "bfloat16", "output": str(tmp_path / "engine"),
        "parallelism": {"tp": 2, "moe_ep": 2}}))
    result = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--dry-run"])
    assert result.exit_code == 0, result.output
    parts = shlex.split(result.output.strip().splitlines()[-1])
    flags = dict(zip(parts[1::2], parts[2::2]))
    assert parts[0] == "trtllm-build" and flags["--moe_plugin"] == "bfloat16"
    assert not (tmp_path / "engine").exists()
    bad = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--tp", "3", "--dry-run"])
    assert bad.exit_code == 2
    assert "parallelism.moe_ep (2) must divide parallelism.tp (3): moe_tp * moe_ep == tp" \
        in bad.output

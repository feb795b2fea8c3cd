"""A checkpoint whose config.json or weights do not make sense is refused at build time: exit 2,
one line naming the field or the tensor, and nothing half-built where `forge serve` or a
repository would find it (no engine directory, no staging directory beside it)."""
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import tiny
from builder.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(shape):
        if shape not in cache:
            cache[shape] = tiny.make_checkpoint(tmp_path_factory.mktemp("hf"), shape)
        return cache[shape]
    return get


def _copy(source, tmp_path, config_changes=None, edit_weights=None):
    import shutil

    target = tmp_path / "hf"
    shutil.copytree(source, target)
    if config_changes:
        config = json.loads((target / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (target / "config.json").write_text(json.dumps(config))
    if edit_weights:
        state = load_file(str(target / "model.safetensors"))
        edit_weights(state)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _build(checkpoint, tmp_path):
    out = tmp_path / "engines" / "hostile"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "hostile", "checkpoint": str(checkpoint), "dtype": "float32",
        "output": str(out), "limits": {"max_batch_size": 2, "max_num_tokens": 64,
                                       "max_input_len": 64, "max_seq_len": 128},
        "kv_cache": {"tokens_per_block": 8, "num_blocks": 32}}))
    return CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository"]), out


def _nan(name):
    def edit(state):
        state[name][0, 0] = float("nan")
    return edit


def _drop(name):
    def edit(state):
        del state[name]
    return edit


def _reshape(name, shape):
    def edit(state):
        state[name] = torch.zeros(shape)
    return edit


CASES = {
    "top_k_past_the_experts": ("family:qwen3_moe", {"num_experts_per_tok": 9}, None,
                               "model.num_experts_per_tok (9) must be <= model.num_experts (8)"),
    "window_of_zero": ("family:gemma3", {"sliding_window": 0}, None,
                       "model.sliding_window must be an integer in [1, max_position_embeddings="
                       "256], got 0"),
    "window_past_the_positions": ("family:mistral", {"sliding_window": 4096}, None,
                                  "model.sliding_window must be an integer in [1, "
                                  "max_position_embeddings=256], got 4096"),
    "heads_do_not_divide_hidden": ("family:llama", {"num_attention_heads": 5, "head_dim": None},
                                   None, "checkpoint: hidden_size (64) is not a multiple of "
                                   "num_attention_heads (5) and config.json gives no head_dim"),
    "layer_pattern_too_short": ("family:gemma3",
                                {"layer_types": ["sliding_attention", "full_attention"]}, None,
                                "model.layer_types must list one type per layer (3), got "
                                "['sliding_attention', 'full_attention']"),
    "layer_pattern_unknown_type": ("family:gemma3", {"layer_types": [
        "sliding_attention", "chunked_attention", "full_attention"]}, None,
        "model.layer_types: ['chunked_attention'] not among ('full_attention', "
        "'sliding_attention')"),
    "missing_tensor": ("family:mixtral", None,
                       _drop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
                       "checkpoint: weight 'model.layers.1.block_sparse_moe.experts.3.w2.weight' "
                       "is missing"),
    "misshapen_tensor": ("family:gemma3", None,
                         _reshape("model.layers.0.self_attn.o_proj.weight", (64, 32)),
                         "checkpoint: model.layers.0.self_attn.o_proj.weight has shape [64, 32], "
                         "config.json implies [64, 64]"),
    "parts_that_do_not_stack": ("family:qwen3", None,
                                _reshape("model.layers.1.self_attn.k_proj.weight", (32, 48)),
                                "checkpoint: model.layers.1.self_attn.q_proj.weight + "
                                "model.layers.1.self_attn.k_proj.weight + "
                                "model.layers.1.self_attn.v_proj.weight have shapes [[64, 64], "
                                "[32, 48], [32, 64]], which do not stack into "
                                "transformer.layers.1.attention.qkv.weight"),
    "nan_weights": ("family:qwen3_moe", None, _nan("model.layers.2.mlp.experts.5.up_proj.weight"),
                    "checkpoint: weight 'model.layers.2.mlp.experts.5.up_proj.weight' has NaN or "
                    "Inf values"),
    "missing_field": ("family:llama", {"intermediate_size": None}, None,
                      "checkpoint: config.json has no 'intermediate_size'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_checkpoint_is_refused_naming_what_is_wrong(checkpoints, tmp_path, case):
    shape, config_changes, edit_weights, message = CASES[case]
    hostile = _copy(checkpoints(shape), tmp_path, config_changes, edit_weights)
    result, out = _build(hostile, tmp_path)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not out.exists(), "a refused build left an engine directory"
    assert not out.parent.exists() or not any(out.parent.iterdir()), list(out.parent.iterdir())


def test_the_same_checkpoint_unharmed_builds(checkpoints, tmp_path):
    """The cases above fail for what they change, not for the way they are built."""
    result, out = _build(_copy(checkpoints("family:gemma3"), tmp_path), tmp_path)
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file()

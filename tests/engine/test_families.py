"""The model-family registry (triton_backend/engine/families/): which checkpoints it reads, the one
weight-name table, and the errors a checkpoint of the wrong family gets."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from builder.pipeline.convert import convert_state_dict, model_shape_from_hf, read_hf_config
from builder.spec.hardware import parameter_count
from triton_backend.engine import families


def test_every_family_is_found_by_its_name_and_its_model_types():
    assert families.architectures() == ["gemma3", "llama", "mistral", "mixtral", "qwen2", "qwen3",
                                        "qwen3_moe"]
    for name in families.architectures():
        family = families.get(name)
        assert all(families.for_model_type(t) is family for t in family.model_types)


def test_an_unknown_family_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"checkpoint: model_type 'gpt2' is not supported "
                                         r"\(supported: \['gemma3', 'gemma3_text', 'llama', "
                                         r"'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]\)"):
        families.for_model_type("gpt2")
    with pytest.raises(ValueError, match=r"model.architecture must be one of \['gemma3', 'llama', "
                                         r"'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\], "
                                         r"got 'gpt2'"):
        families.get("gpt2")


@pytest.mark.parametrize("shape", list(tiny.SHAPES))
def test_the_table_converts_every_checkpoint_tensor_and_counts_every_parameter(tmp_path, shape):
    hf_dir = tiny.make_checkpoint(tmp_path, shape)
    model_shape = model_shape_from_hf(read_hf_config(hf_dir))
    hf_state = load_file(str(hf_dir / "model.safetensors"))
    ours = convert_state_dict(hf_state, model_shape, torch.float32)
    assert sum(t.numel() for t in ours.values()) == sum(
        t.numel() for name, t in hf_state.items()
        if not (name == "lm_head.weight" and model_shape.tie_word_embeddings))
    assert parameter_count(model_shape) == sum(t.numel() for t in ours.values())


def test_the_projections_runtime_names_come_from_the_table():
    llama, qwen3 = families.get("llama"), families.get("qwen3")
    assert llama.runtime_name("model.layers.3.mlp.up_proj") == "transformer.layers.3.mlp.gate_up"
    assert llama.runtime_name("model.layers.0.self_attn.v_proj") == "transformer.layers.0.attention.qkv"
    assert llama.runtime_name("lm_head") == "lm_head"
    assert qwen3.runtime_name("model.layers.1.self_attn.q_norm") is None  # a norm, not a projection
    assert qwen3.fused_input_groups() == [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                          ("mlp.gate_proj", "mlp.up_proj")]


@pytest.mark.parametrize("shape, count, first", [
    ("qwen2_bias_tied", 6, "model.layers.0.self_attn.k_proj.bias"),
    ("qwen3_qk_norm", 4, "model.layers.0.self_attn.k_norm.weight"),
])
def test_a_checkpoint_read_as_the_wrong_family_is_refused_not_half_loaded(tmp_path, shape, count,
                                                                          first):
    """Read as Llama, a Qwen2 checkpoint would lose its QKV biases, a Qwen3 one its QK-norm."""
    hf_dir = tiny.make_checkpoint(tmp_path, shape)
    config = read_hf_config(hf_dir)
    config["model_type"] = "llama"
    config.pop("attention_bias", None)
    (hf_dir / "config.json").write_text(json.dumps(config))
    shape = model_shape_from_hf(read_hf_config(hf_dir))
    with pytest.raises(ValueError, match=rf"checkpoint: {count} weight\(s\) the llama family does "
                                         rf"not read, e.g. \['{first}'"):
        convert_state_dict(load_file(str(hf_dir / "model.safetensors")), shape, torch.float32)


def test_a_missing_weight_is_named(tmp_path):
    hf_dir = tiny.make_checkpoint(tmp_path, "llama_gqa")
    state = load_file(str(hf_dir / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(hf_dir / "model.safetensors"))
    shape = model_shape_from_hf(read_hf_config(hf_dir))
    with pytest.raises(ValueError, match="checkpoint: weight 'model.layers.1.mlp.up_proj.weight' "
                                         "is missing"):
        convert_state_dict(load_file(str(hf_dir / "model.safetensors")), shape, torch.float32)


def test_a_multimodal_gemma3_checkpoint_is_read_as_its_text_model(tmp_path):
    """`gemma3` (Gemma3ForConditionalGeneration): text_config and the language model's weights,
    the vision tower left out; its text-only logits are the engine's."""
    import transformers

    from triton_backend.engine.offline import prefill_logits

    tokenizer = tiny.make_tokenizer(tmp_path / "hf")
    text = {**families.get("gemma3").example, "vocab_size": len(tokenizer), "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16,
            "max_position_embeddings": 256}
    config = transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for name, p in model.named_parameters():
        if "language_model" in name:
            torch.nn.init.normal_(p, mean=0.0, std=0.3 if "norm" in name else 0.15)
    model.save_pretrained(str(tmp_path / "hf"))
    assert read_hf_config(tmp_path / "hf")["model_type"] == "gemma3"
    engine = _build(tmp_path)
    ids = list(range(5, 60))
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, ids), theirs, atol=1e-3, rtol=0)


def _build(tmp_path):
    from rich.console import Console

    from builder.pipeline.engine_builder import build_engine
    from builder.spec.load import spec_from_dict

    return build_engine(spec_from_dict({
        "name": "gemma3-multimodal", "checkpoint": str(tmp_path / "hf"), "dtype": "float32",
        "output": str(tmp_path / "engine"), "kv_cache": {"tokens_per_block": 8, "num_blocks": 64},
        "limits": {"max_batch_size": 4, "max_num_tokens": 128, "max_input_len": 100,
                   "max_seq_len": 200}}), console=Console(quiet=True), emit_repository=False)

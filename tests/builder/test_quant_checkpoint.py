"""The offline half on tiny checkpoints: ModelOpt calibration, the TensorRT-LLM checkpoint layout
(names, dtypes, shapes, config fields pinned), the repack into runtime weights, and the runtime
loading the result."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is the `quant` extra")

import tiny  # noqa: E402
from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine  # noqa: E402
from builder.quantize import calibration, repack, trtllm_checkpoint  # noqa: E402
from triton_backend.engine.config import EngineConfig  # noqa: E402
from triton_backend.engine.offline import prefill_logits  # noqa: E402
from triton_backend.engine.quant import int4  # noqa: E402

CALIBRATION = CalibrationOptions(samples=4, seq_len=32)


def _quantized(tmp_path_factory, shape: str, weights: str, kv_cache: str):
    tmp = tmp_path_factory.mktemp(f"{shape}-{weights}")
    engine_dir = tiny.build_engine(tmp, shape, dtype="bfloat16")
    hf_dir = tmp / f"hf-{shape}"
    options = QuantizeOptions(weights=weights, kv_cache=kv_cache, group_size=32,
                              calibration=CALIBRATION)
    result = quantize_engine(engine_dir, hf_dir, options)
    config, tensors = trtllm_checkpoint.read(engine_dir / "trtllm_checkpoint")
    return engine_dir, hf_dir, result, config, tensors


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    """INT4-AWQ weights + FP8 KV cache on the MHA Llama with llama3 rope scaling."""
    return _quantized(tmp_path_factory, "llama_mha_rope_scaled", "int4_awq", "fp8")


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """FP8 weights + INT8 KV cache on Qwen2 (QKV bias, tied embeddings)."""
    return _quantized(tmp_path_factory, "qwen2_bias_tied", "fp8", "int8")


def _spec(tensors, key):
    return tensors[key].dtype, tuple(tensors[key].shape)


def test_awq_checkpoint_layout_is_trtllm_w4a16_awq(awq):
    _, _, _, config, t = awq
    quant = config["quantization"]
    assert {k: quant[k] for k in ("quant_algo", "kv_cache_quant_algo", "group_size",
                                  "has_zero_point", "pre_quant_scale")} == {
        "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8", "group_size": 32,
        "has_zero_point": False, "pre_quant_scale": True}
    assert "lm_head" in quant["exclude_modules"]
    layer = "transformer.layers.0"
    # hidden 64, 4 heads x 16 (MHA): qkv out 192; intermediate 128; group 32.
    expected = {f"{layer}.attention.qkv.weight": (torch.int8, (96, 64)),
                f"{layer}.attention.qkv.weights_scaling_factor": (torch.float32, (192, 2)),
                f"{layer}.attention.dense.weight": (torch.int8, (32, 64)),
                f"{layer}.mlp.fc.weight": (torch.int8, (64, 64)),
                f"{layer}.mlp.gate.weight": (torch.int8, (64, 64)),
                f"{layer}.mlp.proj.weight": (torch.int8, (32, 128)),
                f"{layer}.mlp.proj.weights_scaling_factor": (torch.float32, (64, 4)),
                f"{layer}.attention.kv_cache_scaling_factor": (torch.float32, (1,)),
                f"{layer}.attention.k_cache_scaling_factor": (torch.float32, (1,)),
                f"{layer}.attention.v_cache_scaling_factor": (torch.float32, (1,))}
    assert {k: _spec(t, k) for k in expected} == expected
    for module in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert t[f"{layer}.{module}.prequant_scaling_factor"].shape[0] == t[f"{layer}.{module}.weight"].shape[1]
    for key in ("transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight",
                f"{layer}.input_layernorm.weight", f"{layer}.post_layernorm.weight"):
        assert key in t and t[key].dtype == torch.bfloat16


def test_awq_checkpoint_maps_fc_to_gate_proj_and_gate_to_up_proj(awq):
    from safetensors.torch import load_file

    _, hf_dir, _, _, t = awq
    hf = load_file(str(hf_dir / "model.safetensors"))
    for ours, theirs in (("mlp.fc", "mlp.gate_proj"), ("mlp.gate", "mlp.up_proj")):
        w = _dequantized(t, f"transformer.layers.1.{ours}")
        reference = hf[f"model.layers.1.{theirs}.weight"]
        assert (w - reference).norm() / reference.norm() < 0.2


def test_checkpoint_config_carries_rope_from_transformers_5(awq):
    _, _, _, config, _ = awq
    assert config["rotary_base"] == 10000.0
    assert config["rotary_scaling"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}


def test_fp8_checkpoint_layout_is_trtllm_fp8(fp8):
    _, _, _, config, t = fp8
    assert config["quantization"]["quant_algo"] == "FP8"
    assert config["quantization"]["kv_cache_quant_algo"] == "INT8"
    layer = "transformer.layers.0"
    assert _spec(t, f"{layer}.attention.qkv.weight") == (torch.float8_e4m3fn, (128, 64))
    assert _spec(t, f"{layer}.attention.qkv.bias") == (torch.bfloat16, (128,))
    for module in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert t[f"{layer}.{module}.weights_scaling_factor"].numel() == 1
        assert t[f"{layer}.{module}.activation_scaling_factor"].numel() == 1


def test_runtime_weights_fuse_gate_up_and_carry_kv_scales(awq, fp8):
    from safetensors.torch import load_file

    engine_dir, _, result, _, _ = awq
    state = load_file(str(engine_dir / "model.safetensors"))
    assert _spec(state, "transformer.layers.0.mlp.gate_up.weight") == (torch.int8, (128, 64))
    assert not any(".mlp.fc." in k or ".mlp.gate." in k or "cache_scaling" in k for k in state)
    config = EngineConfig.load(engine_dir)
    assert (config.quantization.weights, config.kv_cache.dtype) == ("int4_awq", "fp8")
    scales = config.extra["quantization"]["kv_cache_scales"]
    assert len(scales["k"]) == len(scales["v"]) == 2 and min(scales["k"]) >= 1.0
    assert result.linear_size_ratio < 0.35  # 4 bits + one f32 scale per 32 weights
    fp8_dir = fp8[0]
    fp8_state = load_file(str(fp8_dir / "model.safetensors"))
    assert "lm_head.weight" not in fp8_state  # tied embeddings
    assert EngineConfig.load(fp8_dir).extra["quantization"]["kv_cache_scales"]["v"][0] < 1.0


def _dequantized(t: dict, prefix: str) -> torch.Tensor:
    """The dense weight a checkpoint module stands for, in the HF model's input space."""
    if t[f"{prefix}.weight"].dtype == torch.float8_e4m3fn:
        return t[f"{prefix}.weight"].float() * t[f"{prefix}.weights_scaling_factor"].float()
    w = int4.dequantize(int4.unpack(t[f"{prefix}.weight"]), t[f"{prefix}.weights_scaling_factor"])
    # ModelOpt folds AWQ's scale s into the weight (W / s) and multiplies the input by s.
    return w * t[f"{prefix}.prequant_scaling_factor"].float()


def _fake_quantized_reference(hf_dir, tensors: dict):
    """transformers' model with every projection replaced by the checkpoint's dequantized weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        prefix, attn, mlp = f"transformer.layers.{i}", layer.self_attn, layer.mlp
        q, k, v = _dequantized(tensors, f"{prefix}.attention.qkv").split(
            [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features])
        pairs = [(attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v),
                 (attn.o_proj, _dequantized(tensors, f"{prefix}.attention.dense")),
                 (mlp.gate_proj, _dequantized(tensors, f"{prefix}.mlp.fc")),
                 (mlp.up_proj, _dequantized(tensors, f"{prefix}.mlp.gate")),
                 (mlp.down_proj, _dequantized(tensors, f"{prefix}.mlp.proj"))]
        for linear, weight in pairs:
            linear.weight.data.copy_(weight)
    return model


@pytest.mark.parametrize("which,min_cosine", [("awq", 0.995), ("fp8", 0.98)])
def test_runtime_computes_what_the_checkpoint_says(which, min_cosine, request):
    """The runtime's kernels on the repacked weights == the checkpoint's dequantized weights run by
    transformers (FP8 also quantizes activations, hence its looser bound)."""
    engine_dir, hf_dir, _, _, tensors = request.getfixturevalue(which)
    ids = list(range(5, 45))
    ours = prefill_logits(engine_dir, ids)
    with torch.inference_mode():
        theirs = _fake_quantized_reference(hf_dir, tensors)(torch.tensor([ids])).logits[0]
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).mean().item()
    assert cosine > min_cosine


def test_group_size_is_checked_before_calibration(tmp_path):
    hf_dir = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    options = QuantizeOptions(weights="int4_awq", group_size=128)
    from builder.quantize import quantize_checkpoint

    with pytest.raises(ValueError, match=r"group_size 128 does not divide the input size 64 of "
                                         r"transformer\.layers\.0\.attention\.qkv"):
        quantize_checkpoint(hf_dir, tmp_path / "engine", options)


def test_exclusion_that_matches_nothing_is_refused(tmp_path):
    from builder.quantize import quantize_checkpoint

    hf_dir = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    options = QuantizeOptions(weights="fp8", exclude_modules=["lm_head", "q_proj"])
    with pytest.raises(ValueError, match=r"exclude_modules: 'q_proj' matches no module"):
        quantize_checkpoint(hf_dir, tmp_path / "engine", options)


def test_excluded_modules_stay_unquantized(tmp_path):
    from safetensors.torch import load_file

    engine_dir = tiny.build_engine(tmp_path, "llama_gqa", dtype="bfloat16")
    options = QuantizeOptions(weights="fp8", exclude_modules=["lm_head", "layers.1.mlp.proj"],
                              calibration=CALIBRATION)
    quantize_engine(engine_dir, tmp_path / "hf-llama_gqa", options)
    state = load_file(str(engine_dir / "model.safetensors"))
    assert state["transformer.layers.1.mlp.proj.weight"].dtype == torch.bfloat16
    assert state["transformer.layers.0.mlp.proj.weight"].dtype == torch.float8_e4m3fn
    logits = prefill_logits(engine_dir, list(range(5, 20)))  # the runtime agrees on what is excluded
    assert torch.isfinite(logits).all()


def test_repack_refuses_unshared_prequant_scales():
    fc = {"weight": torch.zeros(2, 4, dtype=torch.int8), "prequant_scaling_factor": torch.ones(4)}
    gate = {"weight": torch.zeros(2, 4, dtype=torch.int8), "prequant_scaling_factor": torch.full((4,), 2.0)}
    with pytest.raises(ValueError, match="different AWQ pre-quant scales"):
        repack._fuse_gate_up(fc, gate, "transformer.layers.0")


def test_builtin_calibration_and_heldout_text_are_disjoint():
    cal, held = calibration.load_texts("builtin"), calibration.load_texts("builtin:heldout")
    assert len(cal) > 20 and len(held) > 10
    assert not set(cal) & set(held)


def test_jsonl_calibration_data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "one two"}) + "\n\n" + json.dumps({"text": "three"}) + "\n")
    assert calibration.load_texts(str(path)) == ["one two", "three"]
    path.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"data.jsonl:1: expected a JSON object with a 'text' field"):
        calibration.load_texts(str(path))


def test_fp8_kv_cache_doubles_the_tokens_in_one_budget(awq, tmp_path):
    """The block manager's own count, for the same memory budget, bf16 cache vs fp8 cache."""
    from triton_backend.engine.llm_engine import LLMEngine

    engine_dir = awq[0]
    budget = 1 << 20
    quantized = LLMEngine(engine_dir, kv_cache_memory_bytes=budget).block_manager.num_blocks
    unquantized_dir = tmp_path / "bf16-kv"
    shutil.copytree(engine_dir, unquantized_dir)
    config = EngineConfig.load(unquantized_dir)
    config.kv_cache.dtype = "auto"
    config.save(unquantized_dir)
    baseline = LLMEngine(unquantized_dir, kv_cache_memory_bytes=budget).block_manager.num_blocks
    assert quantized >= 1.9 * baseline



@pytest.fixture(scope="module")
def awq_plain_kv(tmp_path_factory):
    """INT4-AWQ weights with the 16-bit KV cache: what the decode fast path covers."""
    return _quantized(tmp_path_factory, "llama_gqa", "int4_awq", "none")


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_int4_engines_decode_through_the_fast_path_with_the_python_models_tokens(awq_plain_kv,
                                                                                monkeypatch,
                                                                                kernel):
    from tests.engine.test_kernels import _fast_and_python_ids
    from triton_backend.engine.cpu.kernels import load_cpu_kernels
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.cpu import quantized
    from triton_backend.engine.cpu.quantized import Int4Choice

    if not load_cpu_kernels():
        pytest.skip("the C++ kernels did not build")
    # Each decode kernel the per-machine plan may pick, whatever it measures on this machine.
    monkeypatch.setattr(quantized, "int4_choice", lambda key, linear: Int4Choice(kernel))
    engine_dir = awq_plain_kv[0]
    mlp = LLMEngine(engine_dir).runner.model.transformer.layers[0].mlp
    assert mlp.gate_up.kernel == {"cpp": "cpp_int4", "torch": "cpu_int4pack"}[kernel]
    with_fast, without, steps = _fast_and_python_ids(engine_dir)
    assert steps > 10 and with_fast == without

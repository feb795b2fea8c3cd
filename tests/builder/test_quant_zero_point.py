"""Zero-point INT4 (`int4_rtn` with `zero_point: true`), end to end on a tiny checkpoint: the
weights written, the runtime computing what they say, the decode fast path on them; with a
one-byte KV cache, its scales calibrated on the keys and values the INT4 weights produce."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tiny
from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine
from builder.quantize import calibration
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.offline import prefill_logits
from triton_backend.engine.quant import int4

GROUP = 32


@pytest.fixture(scope="module")
def zero_point_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-point")
    engine_dir = tiny.build_engine(tmp, "qwen2_bias_tied", dtype="bfloat16")
    options = QuantizeOptions(weights="int4_rtn", zero_point=True, group_size=GROUP,
                              exclude_modules=["lm_head", "layers.1.mlp.proj"])
    result = quantize_engine(engine_dir, tmp / "hf-qwen2_bias_tied", options)
    return engine_dir, tmp / "hf-qwen2_bias_tied", result


def test_the_engine_records_and_stores_zero_point_int4(zero_point_engine):
    engine_dir, _, result = zero_point_engine
    quant = EngineConfig.load(engine_dir).quantization
    assert (quant.weights, quant.zero_point, quant.group_size) == ("int4_rtn", True, GROUP)
    assert result.extra["quant_algo"] == "W4A16_ZERO_POINT"
    assert not (engine_dir / "trtllm_checkpoint").exists()
    state = load_file(str(engine_dir / "model.safetensors"))
    qkv = "transformer.layers.0.attention.qkv"
    assert state[f"{qkv}.weight"].dtype == torch.int8
    assert state[f"{qkv}.zero"].shape == state[f"{qkv}.weights_scaling_factor"].shape == (
        state[f"{qkv}.weight"].shape[0] * 2, 64 // GROUP)
    assert state[f"{qkv}.bias"].dtype == torch.bfloat16  # biases and norms stay in the engine dtype
    assert state["transformer.layers.1.mlp.proj.weight"].dtype == torch.bfloat16  # excluded
    assert 0.2 < result.linear_size_ratio < 0.5


def _dequantized_reference(hf_dir):
    """transformers on the checkpoint with each quantized projection replaced by its zero-point
    INT4 dequantization (groups run along each row, so quantizing q/k/v apart or fused agree)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                   layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj]
        if i != 1:
            linears.append(layer.mlp.down_proj)
        for linear in linears:
            q, scales, zeros = int4.quantize_rtn_zero_point(linear.weight.data, GROUP)
            linear.weight.data.copy_(int4.dequantize(q, scales, zeros=zeros))
    return model


def test_the_runtime_computes_what_the_weights_say(zero_point_engine):
    engine_dir, hf_dir, _ = zero_point_engine
    ids = list(range(5, 45))
    ours = prefill_logits(engine_dir, ids)
    with torch.inference_mode():
        theirs = _dequantized_reference(hf_dir)(torch.tensor([ids])).logits[0]
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).mean().item()
    assert cosine > 0.995


def test_zero_point_engines_decode_through_the_fast_path_with_the_python_models_tokens(
        zero_point_engine):
    from tests.engine.test_kernels import _fast_and_python_ids
    from triton_backend.engine.cpu.kernels import load_cpu_kernels
    from triton_backend.engine.llm_engine import LLMEngine

    if not load_cpu_kernels():
        pytest.skip("the C++ kernels did not build")
    engine_dir = zero_point_engine[0]
    qkv = LLMEngine(engine_dir).runner.model.transformer.layers[0].attention.qkv
    # Both CPU kernels take the zeros (ours folds them into its packed offsets); which one runs
    # is this machine's measured INT4 plan, and under load the measurement can go either way.
    assert qkv.kernel in ("cpp_int4", "cpu_int4pack")
    with_fast, without, steps = _fast_and_python_ids(engine_dir)
    assert steps > 10 and with_fast == without


KV_CALIBRATION = CalibrationOptions(samples=6, seq_len=48, batch_size=4)


def _zero_point_kv_build(tmp, kv_cache: str):
    engine_dir = tiny.build_engine(tmp, "qwen2_bias_tied", dtype="bfloat16")
    options = QuantizeOptions(weights="int4_rtn", zero_point=True, group_size=GROUP,
                              kv_cache=kv_cache, exclude_modules=["lm_head", "layers.1.mlp.proj"],
                              calibration=KV_CALIBRATION)
    quantize_engine(engine_dir, tmp / "hf-qwen2_bias_tied", options)
    return engine_dir, tmp / "hf-qwen2_bias_tied"


@pytest.fixture(scope="module")
def zero_point_kv_engine(tmp_path_factory):
    return _zero_point_kv_build(tmp_path_factory.mktemp("zero-point-kv"), "int8")


def _reference_kv_amax(hf_dir) -> torch.Tensor:
    """[2, layers]: max |key| (after the rotary embedding) and max |value| that transformers
    computes on the calibration windows, batched as the calibration batches them, with the INT4
    dequantized weights."""
    from transformers import AutoTokenizer

    cal = KV_CALIBRATION
    windows = calibration.windows(AutoTokenizer.from_pretrained(str(hf_dir)), cal)
    model = _dequantized_reference(hf_dir)
    amax = torch.zeros(2, model.config.num_hidden_layers)
    with torch.inference_mode():
        for start in range(0, len(windows), cal.batch_size):
            cache = model(windows[start:start + cal.batch_size], use_cache=True).past_key_values
            for layer in range(model.config.num_hidden_layers):
                keys, values = cache.layers[layer].keys, cache.layers[layer].values
                amax[0, layer] = max(amax[0, layer], keys.abs().max())
                amax[1, layer] = max(amax[1, layer], values.abs().max())
    return amax


def _recorded_scales(engine_dir) -> torch.Tensor:
    scales = EngineConfig.load(engine_dir).extra["quantization"]["kv_cache_scales"]
    return torch.tensor([scales["k"], scales["v"]])


def test_a_zero_point_build_calibrates_its_int8_cache_on_the_int4_keys_and_values(
        zero_point_kv_engine):
    """Each layer's scale is amax/127 of the keys and values the INT4 weights produce."""
    engine_dir, hf_dir = zero_point_kv_engine
    config = EngineConfig.load(engine_dir)
    assert (config.quantization.kv_cache, config.kv_cache.dtype) == ("int8", "int8")
    assert config.quantization.zero_point
    extra = config.extra["quantization"]
    assert (extra["quant_algo"], extra["kv_cache_quant_algo"]) == ("W4A16_ZERO_POINT", "INT8")
    assert extra["calibration"]["samples"] == KV_CALIBRATION.samples == 6
    torch.testing.assert_close(_recorded_scales(engine_dir), _reference_kv_amax(hf_dir) / 127,
                               rtol=1e-4, atol=0)


def test_a_zero_point_build_calibrates_an_fp8_cache_as_modelopt_exports_it(tmp_path):
    """FP8: amax/448, clamped to >= 1 (ModelOpt's TensorRT-LLM export)."""
    engine_dir, hf_dir = _zero_point_kv_build(tmp_path, "fp8")
    config = EngineConfig.load(engine_dir)
    assert (config.kv_cache.dtype, config.extra["quantization"]["kv_cache_quant_algo"]) == (
        "fp8", "FP8")
    expected = torch.clamp(_reference_kv_amax(hf_dir) / 448, min=1.0)
    torch.testing.assert_close(_recorded_scales(engine_dir), expected, rtol=1e-4, atol=0)


def test_a_zero_point_engine_with_an_int8_cache_decodes_through_the_fast_path(
        zero_point_kv_engine):
    from tests.engine.test_kernels import _fast_and_python_ids
    from triton_backend.engine.cpu.kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("the C++ kernels did not build")
    with_fast, without, steps = _fast_and_python_ids(zero_point_kv_engine[0])
    assert steps > 10 and with_fast == without

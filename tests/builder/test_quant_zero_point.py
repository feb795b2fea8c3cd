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
    assert steps > 10
    _agree_up_to_near_ties(engine_dir, with_fast, without)


def _agree_up_to_near_ties(engine_dir, ours, theirs):
    """Greedy ids of `_fast_and_python_ids`' requests equal, or parting only where the logits
    make it a near tie (the two picks within 3 bf16 steps of each other: this random INT4 model
    in bf16 meets one on some CPUs); most tokens compared before any parting."""
    from tests.engine.test_kernels import FAST_PATH_PROMPTS

    compared = 0
    for prompt, a, b in zip(FAST_PATH_PROMPTS, ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        compared += same
        if same < len(a):
            logits = prefill_logits(engine_dir, prompt + a[:same])[-1].float()
            step = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)
            assert abs(logits[a[same]] - logits[b[same]]) <= 3 * step, (prompt, a, b)
    assert compared >= sum(len(a) for a in ours) // 2


def _group_errors(weight, grid, importance=None):
    """Each group's squared error [out, in/g], weighted per input column by `importance`."""
    q, scales, zeros = grid
    err = (int4.dequantize(q, scales, zeros=zeros) - weight) ** 2
    if importance is not None:
        err = err * importance
    return err.reshape(weight.shape[0], -1, GROUP).sum(-1)


def test_the_searched_grid_is_never_worse_than_min_max_in_any_group_and_better_overall():
    torch.manual_seed(0)
    weight = torch.randn(96, 4 * GROUP) * torch.rand(96, 1)
    importance = torch.rand(4 * GROUP) * 4
    minmax = int4.quantize_rtn_zero_point(weight, GROUP)
    for weights in (None, importance):
        searched = int4.quantize_search_zero_point(weight, GROUP, weights, rows=40)
        q, scales, _ = searched
        assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
        assert bool((scales > 0).all())
        ours, theirs = _group_errors(weight, searched, weights), _group_errors(weight, minmax,
                                                                              weights)
        assert bool((ours <= theirs * (1 + 1e-6)).all())
        assert ours.sum() < 0.9 * theirs.sum()
    # Weighting moves the error off the columns that matter: less weighted error than unweighted.
    unweighted = int4.quantize_search_zero_point(weight, GROUP)
    assert (_group_errors(weight, int4.quantize_search_zero_point(weight, GROUP, importance),
                          importance).sum()
            < _group_errors(weight, unweighted, importance).sum())


def test_a_weight_already_on_an_asymmetric_grid_is_reproduced_by_the_search():
    """Q4_1-like groups (every level from -8 to 7 present) stay exact: the min/max grid is
    among the candidates and has no error to beat."""
    torch.manual_seed(1)
    levels = torch.stack([torch.randperm(GROUP) % 16 - 8 for _ in range(64 * 2)])
    q = levels.reshape(64, 2 * GROUP).to(torch.int8)
    scales, zeros = torch.rand(64, 2) + 0.1, torch.randn(64, 2)
    weight = int4.dequantize(q, scales, zeros=zeros)
    for importance in (None, torch.rand(2 * GROUP)):
        got = int4.quantize_search_zero_point(weight, GROUP, importance)
        torch.testing.assert_close(int4.dequantize(*got[:2], zeros=got[2]), weight,
                                   rtol=0, atol=1e-5)  # a level off would be >= 0.1


def test_activation_rounding_measures_each_projections_input_rms_as_transformers_sees_it(
        tmp_path):
    """The importance is our runtime's input RMS per column: equal to the RMS of what
    transformers feeds q_proj / o_proj / gate_proj / down_proj on the same windows; the build
    records the rounding and its calibration, and its grids beat min/max in weighted error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from builder.pipeline import convert
    from builder.quantize import zero_point

    engine_dir = tiny.build_engine(tmp_path, "qwen2_bias_tied", dtype="bfloat16")
    hf_dir = tmp_path / "hf-qwen2_bias_tied"
    cal = CalibrationOptions(samples=4, seq_len=32)
    windows = calibration.windows(AutoTokenizer.from_pretrained(str(hf_dir)), cal)
    shape = convert.model_shape_from_hf(convert.read_hf_config(hf_dir))
    state = convert.convert_state_dict(convert.load_hf_state_dict(hf_dir), shape, torch.float32)
    ours = zero_point.input_rms(state, EngineConfig.load(engine_dir), windows)

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    parts = {"self_attn.q_proj": "attention.qkv", "self_attn.o_proj": "attention.dense",
             "mlp.gate_proj": "mlp.gate_up", "mlp.down_proj": "mlp.proj"}
    inputs = {}
    hooks = [model.get_submodule(f"model.layers.{i}.{hf}").register_forward_hook(
                 lambda _m, args, _o, key=f"transformer.layers.{i}.{rt}":
                 inputs.setdefault(key, []).append(args[0].reshape(-1, args[0].shape[-1])))
             for i in range(model.config.num_hidden_layers) for hf, rt in parts.items()]
    with torch.inference_mode():
        for row in windows:
            model(row[None])
    for hook in hooks:
        hook.remove()
    assert set(ours) == set(inputs)
    for key, rows in inputs.items():
        torch.testing.assert_close(ours[key], torch.cat(rows).square().mean(0).sqrt(),
                                   rtol=1e-4, atol=1e-6)

    options = QuantizeOptions(weights="int4_rtn", zero_point=True, group_size=GROUP,
                              rounding="activation", calibration=cal)
    quantize_engine(engine_dir, hf_dir, options)
    extra = EngineConfig.load(engine_dir).extra["quantization"]
    assert extra["rounding"] == "activation"
    assert extra["rounding_calibration"]["samples"] == len(windows) == 4
    stored = load_file(str(engine_dir / "model.safetensors"))
    qkv = "transformer.layers.0.attention.qkv"
    grid = (int4.unpack(stored[f"{qkv}.weight"]), stored[f"{qkv}.weights_scaling_factor"],
            stored[f"{qkv}.zero"])
    weight, importance = state[f"{qkv}.weight"], ours[qkv]
    assert (_group_errors(weight, grid, importance).sum()
            < _group_errors(weight, int4.quantize_rtn_zero_point(weight, GROUP),
                            importance).sum())


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

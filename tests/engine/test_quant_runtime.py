"""The runtime half of quantization: INT4 packing, quantized linears, the one-byte KV cache."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from triton_backend.engine.config import EngineConfig, ModelShape
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.quant import (Fp8Linear, Int4WeightOnlyLinear, make_quantized_kv_cache,
                                         quantized_kv_bytes_per_token)
from triton_backend.engine.quant import int4
from triton_backend.engine.quant.kv_cache import dequantize_kv, quantize_kv


def test_int4_pack_unpack_round_trip_is_exact():
    q = torch.randint(-8, 8, (64, 48), dtype=torch.int8)
    packed = int4.pack(q)
    assert packed.dtype == torch.int8 and packed.shape == (32, 48)
    assert torch.equal(int4.unpack(packed), q)


def test_int4_packing_puts_even_rows_in_the_low_nibble():
    q = torch.tensor([[1], [-2]], dtype=torch.int8)  # rows 0 and 1 of one input column
    byte = int(int4.pack(q).view(torch.uint8)[0, 0])
    assert byte & 0x0F == 1 and byte >> 4 == 0xE  # -2 as a 4-bit two's complement


def test_int4_packing_matches_modelopt_export():
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils",
                                      reason="nvidia-modelopt is the `quant` extra")
    w = torch.randn(32, 64)
    q, scales = int4.quantize_rtn(w, 32)
    theirs = quant_utils.pack_int4_in_uint8(w, scales, 32)
    assert torch.equal(int4.pack(q).view(torch.uint8), theirs.view(torch.uint8))


def test_group_size_that_does_not_divide_names_the_layer():
    with pytest.raises(ValueError, match=r"group_size 128 does not divide the input size 576 of "
                                         r"transformer.layers.0.attention.qkv.*64"):
        int4.check_group_size(576, 128, "transformer.layers.0.attention.qkv")


def _int4_linear(out_f: int, in_f: int, group: int, prequant: bool, bias: bool):
    w = torch.randn(out_f, in_f)
    q, scales = int4.quantize_rtn(w, group)
    pre = torch.rand(in_f) + 0.5 if prequant else None
    b = torch.randn(out_f) if bias else None
    linear = Int4WeightOnlyLinear(in_f, out_f, bias, group, "test")
    state = {"weight": int4.pack(q), "weights_scaling_factor": scales}
    if pre is not None:
        state["prequant_scaling_factor"] = pre
    if b is not None:
        state["bias"] = b
    linear.load_state_dict(state, strict=True)
    return linear, int4.dequantize(q, scales), pre, b


def _for_kernel(linear, choice):
    """`linear` repacked as the CPU backend's `prepare` would for `choice` (an Int4Choice; None:
    no kernel of ours, torch's int4pack where it takes the shape); skips when the C++ kernels did
    not build and the choice needs them."""
    from triton_backend.engine.cpu.kernels import load_cpu_kernels
    from triton_backend.engine.cpu.quantized import CppInt4Linear

    if choice is None:
        linear.use_int4pack()
        return linear
    if not load_cpu_kernels():
        pytest.skip("the C++ kernels did not build")
    return CppInt4Linear.repack(linear, choice)


@pytest.mark.parametrize("out_f,ours,kernel", [(96, True, "cpp_int4"), (40, True, "cpp_int4"),
                                               (96, False, "cpu_int4pack"), (40, False, "dequant")])
def test_int4_linear_matches_dequantized_reference(out_f, ours, kernel, monkeypatch):
    """Each CPU path: our kernel (any even width), torch's int4pack (widths of 16), dequant."""
    from triton_backend.engine.cpu.quantized import Int4Choice

    torch.manual_seed(0)
    linear, w_ref, pre, b = _int4_linear(out_f, 64, 32, prequant=True, bias=True)
    linear = _for_kernel(linear, Int4Choice("cpp") if ours else None)
    assert linear.kernel == kernel
    x = torch.randn(5, 64)
    ref = torch.nn.functional.linear(x * pre, w_ref, b)
    for dtype, tol in ((torch.float32, 0.05), (torch.bfloat16, 0.05)):
        y = linear(x.to(dtype)).float()
        assert (y - ref).abs().max() / ref.abs().max() < tol
    assert torch.allclose(linear.dequantized_weight(), w_ref, rtol=1e-2, atol=1e-2)


def test_int4_linear_dequantizes_for_torchs_gemm_from_its_upcast_row_count(monkeypatch):
    from triton_backend.engine.cpu.quantized import Int4Choice

    torch.manual_seed(1)
    linear, w_ref, pre, b = _int4_linear(40, 64, 32, prequant=True, bias=True)
    linear = _for_kernel(linear, Int4Choice("cpp", 4))
    assert linear.upcast_min_rows == 4
    x = torch.randn(3, 64)  # the kernel: int8 activations
    ref = F.linear(x * pre, w_ref, b)
    assert (linear(x) - ref).abs().max() / ref.abs().max() < 0.02
    x = torch.randn(9, 64)  # the dequantized weight (fp16 scales), fp32 activations
    dense = linear.dequantized_weight()
    torch.testing.assert_close(dense, w_ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(linear(x), F.linear(x * pre, dense, b), atol=1e-4, rtol=1e-4)


def test_int4_linear_meets_bf16_activations_in_the_planned_dtype(monkeypatch):
    """A plan with upcast_dtype bfloat16: a bf16 prefill multiplies by the bf16-rounded weight
    (torch's bf16 GEMM); fp32 activations still take the fp32 weight, exactly."""
    from triton_backend.engine.cpu.quantized import Int4Choice

    torch.manual_seed(2)
    linear, w_ref, pre, b = _int4_linear(40, 64, 32, prequant=True, bias=True)
    linear = _for_kernel(linear, Int4Choice("cpp", 4, "bfloat16"))
    assert linear.upcast_dtype == torch.bfloat16
    x = torch.randn(9, 64)
    dense = linear.dequantized_weight()
    torch.testing.assert_close(linear(x), F.linear(x * pre, dense, b), atol=1e-4, rtol=1e-4)
    xb = x.to(torch.bfloat16)
    expected = F.linear(xb * pre.to(torch.bfloat16), dense.to(torch.bfloat16)) + b.to(xb.dtype)
    assert torch.equal(linear(xb), expected)


def test_with_torchs_int4_kernel_a_large_prefill_dequantizes_our_layout(monkeypatch):
    """torch's int4pack wins decode-sized calls, dequantizing wins from 4 rows: our layout is kept
    beside torch's for that, and both paths multiply by the same weight."""
    from triton_backend.engine.cpu.quantized import Int4Choice

    torch.manual_seed(3)
    linear, w_ref, pre, b = _int4_linear(96, 64, 32, prequant=True, bias=True)
    linear = _for_kernel(linear, Int4Choice("torch", 4, "bfloat16"))
    assert linear.kernel == "cpu_int4pack" and linear.tiles is not None
    dense = linear.dequantized_weight()  # our layout's (fp16 scales)
    torch.testing.assert_close(dense, w_ref, atol=1e-3, rtol=1e-3)
    x = torch.randn(3, 64)  # torch's int4pack (bf16 inside)
    ref = F.linear(x * pre, w_ref, b)
    assert (linear(x) - ref).abs().max() / ref.abs().max() < 0.05
    x = torch.randn(9, 64)  # the dequantized weight, in fp32 for fp32 activations
    torch.testing.assert_close(linear(x), F.linear(x * pre, dense, b), atol=1e-4, rtol=1e-4)
    xb = torch.randn(9, 64).to(torch.bfloat16)
    expected = F.linear(xb * pre.to(torch.bfloat16), dense.to(torch.bfloat16)) + b.to(xb.dtype)
    assert torch.equal(linear(xb), expected)


def test_int4_linear_rejects_a_mis_shaped_checkpoint():
    linear = Int4WeightOnlyLinear(64, 32, False, 32, "test")
    state = {"weight": torch.zeros(32, 64, dtype=torch.int8),
             "weights_scaling_factor": torch.ones(32, 2)}
    with pytest.raises(RuntimeError, match=r"weight: expected shape \(16, 64\)"):
        linear.load_state_dict(state)


@pytest.mark.parametrize("per_row_scale,use_scaled_mm", [(False, None), (False, True), (True, None),
                                                          (True, True)])
def test_fp8_linear_matches_dequantized_reference(per_row_scale, use_scaled_mm):
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    w_scale = (w.abs().amax(dim=1) if per_row_scale else w.abs().amax().reshape(1)) / 448
    scale = w_scale[:, None] if per_row_scale else w_scale
    w8 = (w / scale).to(torch.float8_e4m3fn)
    x = torch.randn(4, 64)
    linear = Fp8Linear(64, 32, False, "test")
    linear.load_state_dict({"weight": w8, "weights_scaling_factor": w_scale,
                            "activation_scaling_factor": (x.abs().amax() / 448).reshape(1)})
    assert linear.kernel == "dequant"  # no native FP8 GEMM on a CPU
    if use_scaled_mm:  # torch's emulated CPU kernel: same numerics as the GPU path
        linear.load_quantized(w8, w_scale, (x.abs().amax() / 448).reshape(1), None, use_scaled_mm=True)
        assert linear.kernel == "scaled_mm"
    ref = x @ (w8.float() * scale).t()
    y = linear(x.to(torch.bfloat16)).float()
    assert (y - ref).abs().max() / ref.abs().max() < 0.08


@pytest.mark.parametrize("kv_dtype,tol", [("fp8", 0.07), ("int8", 0.01)])
def test_kv_quantize_round_trip(kv_dtype, tol):
    x = torch.randn(10, 2, 16)
    scale = 1.0 if kv_dtype == "fp8" else float(x.abs().max() / 127)
    stored = quantize_kv(x, scale, kv_dtype)
    assert stored.element_size() == 1
    back = dequantize_kv(stored, scale, torch.float32)
    assert (back - x).abs().max() <= tol * x.abs().max()


def _config(kv_dtype: str) -> EngineConfig:
    shape = ModelShape("llama", 128, 64, 128, 2, 4, 2, 16)
    data = {"name": "t", "target": "torch", "dtype": "bfloat16", "model": shape,
            "extra": {"quantization": {"kv_cache_scales": {"k": [1.0, 2.0], "v": [1.0, 0.5]}}}}
    config = EngineConfig(**data)
    config.kv_cache.dtype = kv_dtype
    return config


def test_one_byte_kv_cache_holds_twice_the_tokens_of_bf16():
    config = _config("fp8")
    bf16 = PagedKVCache.bytes_per_token(config.model, torch.bfloat16)
    assert bf16 / quantized_kv_bytes_per_token(config) == 2


def test_quantized_kv_cache_writes_and_gathers_with_layer_scales():
    config = _config("int8")
    cache = make_quantized_kv_cache(config, num_blocks=2, device="cpu")
    assert cache.k.dtype == torch.int8
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([0, 5, 17])
    cache.write(1, slots, k, v)
    gk, gv = cache.gather(1, slots, torch.float32)
    assert (gk - k).abs().max() <= 1.0 and (gv - v).abs().max() <= 0.25  # half a step each
    assert torch.equal(cache.k[1][slots], quantize_kv(k, 2.0, "int8"))


def test_kv_cache_without_scales_names_the_missing_field():
    config = _config("fp8")
    config.extra = {}
    with pytest.raises(ValueError, match="extra.quantization.kv_cache_scales"):
        make_quantized_kv_cache(config, num_blocks=1)


def test_a_group_size_torchs_int4_kernel_refuses_is_planned_for_ours(monkeypatch, tmp_path):
    """torch's int4pack takes groups of 32..256 only: for group 16 the plan measures our kernel
    alone (it raised inside the measurement before), and caches that choice with the prefill
    row counts it timed."""
    from triton_backend.engine.cpu.kernels import build_key, load_cpu_kernels
    from triton_backend.engine.cpu.quantized import int4_kernel_choice

    if not load_cpu_kernels():
        pytest.skip("the C++ kernels did not build")
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    # A plan written by an older rule (no version) is measured again, not read.
    path = tmp_path / "kernels" / build_key() / "int4_plan.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"64x32/g16": {"choice": {"kernel": "torch"}}}))
    choice = int4_kernel_choice(build_key(), 64, 32, 16)
    assert choice.kernel == "cpp"
    plan = json.loads(path.read_text())["64x32/g16"]
    assert plan["torch_over_ours_time"] == [] and plan["version"] == 3
    assert sorted(map(int, plan["upcast_over_kernel_time"]["bfloat16"])) == [32, 64, 128, 256,
                                                                            512, 1024]


def test_zero_point_int4_reproduces_weights_already_on_an_asymmetric_grid():
    """A GGUF Q4_1-like weight (per group of 32: min + d * k, k in 0..15, both ends used) comes
    back exactly; the symmetric grid of int4_rtn cannot hold it."""
    torch.manual_seed(4)
    groups = torch.randint(0, 16, (8, 4, 32)).float()
    groups[..., 0], groups[..., 1] = 0, 15
    d, low = torch.rand(8, 4, 1) * 0.01 + 0.001, torch.randn(8, 4, 1) * 0.05
    w = (low + d * groups).reshape(8, 128)
    q, scales, zeros = int4.quantize_rtn_zero_point(w, 32)
    assert q.min() == -8 and q.max() == 7
    torch.testing.assert_close(int4.dequantize(q, scales, zeros=zeros), w, atol=1e-6, rtol=0)
    q_sym, s_sym = int4.quantize_rtn(w, 32)
    assert (int4.dequantize(q_sym, s_sym) - w).abs().max() > 1e-3


def _zero_point_linear(out_f: int, in_f: int, group: int):
    w = torch.randn(out_f, in_f) + 0.5  # off-centre groups: the zeros matter
    q, scales, zeros = int4.quantize_rtn_zero_point(w, group)
    b = torch.randn(out_f)
    linear = Int4WeightOnlyLinear(in_f, out_f, True, group, "test", zero_point=True)
    linear.load_state_dict({"weight": int4.pack(q), "weights_scaling_factor": scales,
                            "zero": zeros, "bias": b}, strict=True)
    return linear, int4.dequantize(q, scales, zeros=zeros), b


@pytest.mark.parametrize("plan, out_f, kernel", [
    ("cpp", 96, "cpp_int4"),         # ours: zeros folded into per-group offsets
    ("torch", 96, "cpu_int4pack"),
    ("none", 40, "dequant"),         # no kernel takes 40 rows
    ("upcast", 96, "cpp_int4"),      # prefills of 4+ rows dequantize (with the zeros)
])
def test_zero_point_int4_linear_matches_its_dequantized_weight(monkeypatch, plan, out_f, kernel):
    from triton_backend.engine.cpu.quantized import Int4Choice

    choices = {"cpp": Int4Choice("cpp"), "torch": Int4Choice("torch"), "none": None,
               "upcast": Int4Choice("cpp", 4, "float32")}
    torch.manual_seed(5)
    linear, w_ref, b = _zero_point_linear(out_f, 64, 32)
    linear = _for_kernel(linear, choices[plan])
    assert linear.kernel == kernel
    x = torch.randn(9, 64)
    ref = F.linear(x, w_ref, b)
    for dtype in (torch.float32, torch.bfloat16):
        y = linear(x.to(dtype)).float()
        assert (y - ref).abs().max() / ref.abs().max() < 0.02
    torch.testing.assert_close(linear.dequantized_weight(), w_ref, atol=2e-2, rtol=1e-2)


def test_a_zero_point_layer_without_its_zeros_is_a_load_error():
    linear = Int4WeightOnlyLinear(64, 32, False, 32, "test", zero_point=True)
    q, scales, _ = int4.quantize_rtn_zero_point(torch.randn(32, 64), 32)
    result = linear.load_state_dict({"weight": int4.pack(q), "weights_scaling_factor": scales},
                                    strict=False)
    assert result.missing_keys == ["zero"]

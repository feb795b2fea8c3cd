"""The kernels with int8 activations (gemm_int4_dot.cpp: INT4 weights, and the int8 LM head)
against an exact reference of the same numbers: activations quantized per block of 32 (round
half to even), integer dot products, then the per-block and per-group scales in float64."""
import pytest
import torch

from triton_backend.engine.cpu.kernels import load_cpu_kernels
from triton_backend.engine.cpu.linear import PackedBf16Linear
from triton_backend.engine.cpu.quantized import (Int8Head, dequantize_int4, pack_int4_dot,
                                                 quantize_lm_head)
from triton_backend.engine.quant import int4

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels did not build")


def _weight(n: int, k: int, group: int, zero_point: bool):
    w = torch.randn(n, k) + (0.3 if zero_point else 0.0)
    if zero_point:
        return int4.quantize_rtn_zero_point(w, group)
    return (*int4.quantize_rtn(w, group), None)


def _stored(q, scales, zeros):
    """The unsigned nibbles and the fp16-rounded scales and offsets the kernel multiplies by."""
    scale16 = scales.half().double()
    offset = (zeros.float() if zeros is not None else 0) - 8 * scales.float()
    return (q.to(torch.int64) + 8), scale16, offset.half().double()


def _quantized_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K / block, block], a [M, K / block]) in float64, as the kernels do it."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    # 127 / amax divided in fp32 (a Python scalar over a tensor is a reciprocal times 127 in
    # torch, rounded twice), then the fp32 product, rounded half to even.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xb * inv).double(), (amax / 127.0).double().view(m, k // block)


def _reference(x: torch.Tensor, q, scales, zeros, group: int) -> torch.Tensor:
    """y[m, n] = sum_g s_g * sum_b a_b * (u . q_x)_b + c_g * sum_b a_b * sum(q_x)_b, in float64."""
    m, k = x.shape
    block = 32 if group % 32 == 0 else group
    xq, a = _quantized_rows(x, block)
    u, scale, offset = _stored(q, scales, zeros)
    n = u.shape[0]
    dots = torch.einsum("mbk,nbk->mnb", xq, u.view(n, k // block, block).double()) * a[:, None]
    per_group = group // block
    dots = dots.view(m, n, k // group, per_group).sum(-1)
    x_sums = (xq.sum(-1) * a).view(m, k // group, per_group).sum(-1)
    return (dots * scale[None]).sum(-1) + x_sums @ offset.t()


@pytest.mark.parametrize("n, k, group, zero_point, m", [
    (40, 64, 32, False, 1),     # a partial panel
    (96, 64, 16, True, 3),      # blocks of a group smaller than 32
    (576, 576, 32, True, 16),
    (200, 512, 64, False, 5),   # two blocks per group
    (64, 1536, 128, True, 2),
    (96, 256, 32, True, 70),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_computes_the_w4a8_sums_exactly(n, k, group, zero_point, m, dtype):
    torch.manual_seed(n + k + m)
    q, scales, zeros = _weight(n, k, group, zero_point)
    packed, params = pack_int4_dot(q, scales, zeros)
    x = torch.randn(m, k).to(dtype)  # bf16 rows hit exact ties (x = amax / 2) often
    y = torch.ops.llm_forge.linear_int4_packed(x.float(), packed, params, None, None, group, n)
    ref = _reference(x.float(), q, scales, zeros, group)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    # Against the unquantized activations the int8 rounding costs well under a percent.
    u, scale, offset = _stored(q, scales, zeros)
    w = u.double() * scale.repeat_interleave(group, 1) + offset.repeat_interleave(group, 1)
    full = x.double() @ w.t()
    assert ((y.double() - full).abs().max() / full.abs().max()).item() < 0.01


def test_the_int4_layout_dequantizes_to_the_stored_weight():
    torch.manual_seed(1)
    for zero_point in (False, True):
        q, scales, zeros = _weight(72, 128, 32, zero_point)
        packed, params = pack_int4_dot(q, scales, zeros)
        assert packed.shape == (3, 16, 128) and params.shape == (3, 4, 64)
        u, scale, offset = _stored(q, scales, zeros)
        w = (u.double() * scale.repeat_interleave(32, 1)
             + offset.repeat_interleave(32, 1)).float()
        assert torch.equal(dequantize_int4(packed, params, 32, 72), w)


def test_an_int4_row_does_not_depend_on_its_batch_and_bf16_rows_round_once():
    torch.manual_seed(2)
    q, scales, zeros = _weight(160, 576, 32, True)
    packed, params = pack_int4_dot(q, scales, zeros)
    x, bias = torch.randn(13, 576), torch.randn(160)
    batch = torch.ops.llm_forge.linear_int4_packed(x, packed, params, None, bias, 32, 160)
    for i in (0, 6, 12):
        alone = torch.ops.llm_forge.linear_int4_packed(x[i:i + 1], packed, params, None, bias, 32,
                                                       160)
        assert torch.equal(alone[0], batch[i])
    xb = x.bfloat16()
    y16 = torch.ops.llm_forge.linear_int4_packed(xb, packed, params, None, bias, 32, 160)
    y32 = torch.ops.llm_forge.linear_int4_packed(xb.float(), packed, params, None, bias, 32, 160)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.bfloat16())


def test_the_awq_scale_is_applied_before_the_activations_are_quantized():
    torch.manual_seed(3)
    q, scales, _ = _weight(64, 128, 64, False)
    packed, params = pack_int4_dot(q, scales)
    pre = torch.rand(128) + 0.5
    x = torch.randn(4, 128).bfloat16()
    y = torch.ops.llm_forge.linear_int4_packed(x, packed, params, pre, None, 64, 64)
    scaled = x * pre.to(x.dtype)  # rounded as torch rounds it, then quantized
    expected = torch.ops.llm_forge.linear_int4_packed(scaled, packed, params, None, None, 64, 64)
    assert torch.equal(y, expected)


def test_the_int4_kernel_names_a_bad_layout():
    q, scales, _ = _weight(32, 64, 32, False)
    packed, params = pack_int4_dot(q, scales)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="scale_offsets must be a contiguous fp16"):
        torch.ops.llm_forge.linear_int4_packed(x, packed, params.float(), None, None, 32, 32)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 8 that divides K"):
        torch.ops.llm_forge.linear_int4_packed(x, packed, params, None, None, 12, 32)
    with pytest.raises(RuntimeError, match="x has 63 features, the weight 64"):
        torch.ops.llm_forge.linear_int4_packed(x[:, :63], packed, params, None, None, 32, 32)
    with pytest.raises(ValueError, match="in_features divisible by 8, got 60"):
        pack_int4_dot(q[:, :60], scales)


@pytest.mark.parametrize("n, k, m", [(100, 64, 1), (300, 576, 16), (64, 96, 5), (4096, 576, 2)])
def test_the_int8_head_computes_the_w8a8_sums_exactly(n, k, m):
    torch.manual_seed(n + m)
    weight = torch.randn(n, k).bfloat16()
    head = Int8Head(weight)
    dense = head.dequantized_weight()
    # Q8_0: within half a step of each block's scale (max |w| / 127) of the weight.
    steps = weight.float().view(n, k // 32, 32).abs().amax(-1) / 127
    assert ((dense - weight.float()).view(n, k // 32, 32).abs()
            <= steps[..., None] * 0.5 + 1e-3 * steps[..., None]).all()
    x = torch.randn(m, k).bfloat16()
    logits = head.forward_fp32(x)
    xq, a = _quantized_rows(x.float(), 32)
    ref = ((xq * a[..., None]).reshape(m, k) @ dense.double().t())
    assert logits.dtype == torch.float32
    assert ((logits.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    for i in range(m):
        assert torch.equal(head.forward_fp32(x[i:i + 1])[0], logits[i])
    assert head(x).dtype == torch.bfloat16


def test_the_int8_head_keeps_weights_already_on_the_q8_0_grid():
    torch.manual_seed(7)
    q = torch.randint(-127, 128, (64, 128)).float()
    q[:, ::32] = 127  # every block reaches the end of its range
    scale = (torch.rand(64, 4) * 0.01 + 0.001).half().float()
    weight = q * scale.repeat_interleave(32, 1)
    assert torch.equal(Int8Head(weight).dequantized_weight(), weight)


def test_quantize_lm_head_swaps_a_packed_head_and_the_embedding_keeps_bf16_rows():
    torch.manual_seed(8)
    table = torch.randn(96, 64).bfloat16()

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = PackedBf16Linear(table, None)
            self.transformer = torch.nn.Module()

    model = Tied()
    assert quantize_lm_head(model) and isinstance(model.lm_head, Int8Head)
    torch.testing.assert_close(model.lm_head.dequantized_weight(), table.float(), atol=0.05,
                               rtol=0)
    odd = Tied()
    odd.lm_head = PackedBf16Linear(torch.randn(96, 40).bfloat16(), None)
    assert not quantize_lm_head(odd)  # 40 inputs: not whole blocks of 32
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32, got 40"):
        torch.ops.llm_forge.linear_int8_packed(torch.randn(1, 40), torch.zeros(1, 10, 128,
                                               dtype=torch.uint8), torch.zeros(1, 1, 32).half(),
                                               32, True)


def test_an_engine_built_with_an_int8_lm_head_serves_it_and_passes_its_gate(tmp_path):
    """`quantization.lm_head: int8` end to end: the spec reaches the engine config, the build
    runs the quality gate, and the runtime swaps the tied head for the int8 one; the prefill
    logits stay within a percent of the bf16 engine's."""
    import tiny
    from triton_backend.engine import Request
    from triton_backend.engine.config import EngineConfig
    from triton_backend.engine.llm_engine import LLMEngine

    plain = tiny.build_engine(tmp_path / "bf16", "qwen2_bias_tied", dtype="bfloat16")
    quantized = tiny.build_engine(tmp_path / "int8", "qwen2_bias_tied", dtype="bfloat16",
                                  quantization={"lm_head": "int8"})
    assert EngineConfig.load(quantized).quantization.lm_head == "int8"
    assert (quantized / "quality.json").is_file() and not (plain / "quality.json").is_file()
    logits = []
    for engine_dir in (plain, quantized):
        engine = LLMEngine(engine_dir, enable_prefix_caching=False)
        assert isinstance(engine.runner.model.lm_head, Int8Head) == (engine_dir == quantized)
        engine.add_request(Request(list(range(5, 40)), 1))
        engine.step(return_logits=True)
        logits.append(engine.last_logits.float())
    assert logits[0].shape == logits[1].shape
    assert ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item() < 0.02

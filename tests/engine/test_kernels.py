"""The C++ CPU kernels against the pure-torch reference they replace, op by op and end to end."""
import math
import platform

import pytest
import torch
import torch.nn.functional as F

from triton_backend.engine.cpu import linear
from triton_backend.engine.cpu.kernels import load_cpu_kernels
from triton_backend.engine.cpu.linear import (PLAN_ENV, Bf16GemmPlan, PackedBf16Linear,
                                                  _plan_from_timings, available_layouts,
                                                  bf16_gemm_plan, pack_weight)
from triton_backend.engine.cpu.ops import CppOps
from triton_backend.engine.ops import TorchOps

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels did not build")
DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact_bf16: bool = False):
    if dtype == torch.bfloat16 and exact_bf16:
        assert torch.equal(a, b)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_fused_residual_add_match_torch(dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(7, 100).to(dtype), torch.randn(7, 100).to(dtype)
    weight = torch.randn(100).to(dtype)
    _close(CppOps().rms_norm(x, weight, 1e-5), TorchOps().rms_norm(x, weight, 1e-5), dtype,
           exact_bf16=True)
    ref_out, ref_res = TorchOps().add_rms_norm(x, residual, weight, 1e-5)
    mine = residual.clone()
    out, new_residual = CppOps().add_rms_norm(x, mine, weight, 1e-5)
    assert new_residual is mine  # updated in place
    _close(new_residual, ref_res, dtype, exact_bf16=True)
    _close(out, ref_out, dtype, exact_bf16=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_add_rows_is_the_torch_expression_it_replaces(dtype):
    """out += (x @ A^T @ B^T) rounded to out's dtype, on rows of a wider batch (a view), with
    widths that are not multiples of the vector length; the other rows untouched."""
    torch.manual_seed(0)
    x, out = torch.randn(5, 70).to(dtype), torch.randn(5, 37).to(dtype)
    a, b = torch.randn(70, 12), torch.randn(12, 37)
    expected = out.clone()
    expected[1:4] += (x[1:4].float() @ a @ b).to(dtype)
    torch.ops.llm_forge.lora_add_rows(out.narrow(0, 1, 3), x.narrow(0, 1, 3), a, b)
    assert torch.equal(out[[0, 4]], expected[[0, 4]])
    _close(out, expected, dtype)
    bf16_weights = out.clone()  # weights in bf16 are widened exactly: the same sums
    torch.ops.llm_forge.lora_add_rows(bf16_weights, x, a.bfloat16(), b.bfloat16())
    widened = out.clone()
    torch.ops.llm_forge.lora_add_rows(widened, x, a.bfloat16().float(), b.bfloat16().float())
    assert torch.equal(bf16_weights, widened)
    with pytest.raises(RuntimeError, match="lora_add_rows: shapes do not chain"):
        torch.ops.llm_forge.lora_add_rows(out, x, b, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = (torch.randn(5, 2 * 67) * 4).to(dtype)  # odd width: the scalar tail runs too
    _close(CppOps().silu_mul(gate_up), TorchOps().silu_mul(gate_up), dtype, exact_bf16=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_in_place_matches_the_split_norms(dtype):
    """QK-norm over the fused projection in place: every q and k head normed, v untouched."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 4, 2, 40
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q_weight, k_weight = torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype)
    theirs = TorchOps().qk_norm(qkv.clone(), q_weight, k_weight, heads, kv_heads, 1e-6)
    ours = CppOps().qk_norm(qkv.clone(), q_weight, k_weight, heads, kv_heads, 1e-6)
    _close(ours, theirs, dtype, exact_bf16=True)  # rounded where torch rounds, as rms_norm
    assert torch.equal(ours[:, -kv_heads * head_dim:], qkv[:, -kv_heads * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_torch(dtype):
    """Gemma's gate: GELU's tanh form, as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)); large
    negative and positive gates included (no overflow to NaN)."""
    gate_up = (torch.randn(5, 2 * 67) * 4).to(dtype)  # odd width: the scalar tail runs too
    gate_up[0, :3] = torch.tensor([-80.0, 80.0, 0.0])
    ours, theirs = CppOps().gelu_tanh_mul(gate_up), TorchOps().gelu_tanh_mul(gate_up)
    assert bool(torch.isfinite(ours).all())
    _close(ours, theirs, dtype, exact_bf16=False)


def _layouts():
    """Every packed layout, the ones this CPU cannot run marked skipped (named, not hidden)."""
    if not load_cpu_kernels():
        return ["tiles", "pairs", "amx"]
    return ["tiles"] + [pytest.param("pairs", marks=pytest.mark.skipif(
        "pairs" not in available_layouts(), reason="no AVX-512 BF16 on this CPU")),
        pytest.param("amx", marks=pytest.mark.skipif(
            "amx" not in available_layouts(), reason="no AMX-BF16 (or no tile state) here"))]


@pytest.mark.parametrize("layout", _layouts())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 13, 100])
def test_packed_linear_matches_a_float32_matmul(dtype, m, layout):
    torch.manual_seed(m)
    weight = torch.randn(50, 72).to(torch.bfloat16)  # 50 outputs: a partial last tile
    bias = torch.randn(50).to(torch.bfloat16)
    x = torch.randn(m, 72).to(dtype)
    out = PackedBf16Linear(weight, bias, layout=layout)(x)
    assert out.dtype == dtype and out.shape == (m, 50)
    expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_upcast_min_rows_the_weight_is_widened_for_torchs_gemm(dtype):
    torch.manual_seed(2)
    weight, bias = torch.randn(40, 48).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    kernel, widening = PackedBf16Linear(weight, bias), PackedBf16Linear(weight, bias, 4)
    few, many = torch.randn(3, 48).to(dtype), torch.randn(9, 48).to(dtype)
    assert torch.equal(widening(few), kernel(few))  # below the threshold: the kernel itself
    _close(widening(many), kernel(many), dtype)
    _close(widening(many), F.linear(many.float(), weight.float(), bias.float()).to(dtype), dtype)


@pytest.mark.parametrize("torch_over_packed, upcast_over_packed, plan", [
    ([0.9, 3.0], {256: 0.5, 512: 0.5}, Bf16GemmPlan(False)),      # torch's GEMM is faster at 1
    ([0.99, 1.98], {}, Bf16GemmPlan(True)),   # a tie at one row (both at memory speed), 2x at 16
    ([0.99, 1.05], {256: 1.0}, Bf16GemmPlan(False)),  # 10% better nowhere
    ([1.5, 5.0], {256: 0.95, 512: 0.85, 1024: 0.8}, Bf16GemmPlan(True, 512)),
    ([1.5, 5.0], {256: 0.8, 512: 1.2, 1024: 0.8}, Bf16GemmPlan(True, 1024)),  # must hold above
    ([1.5, 5.0], {256: 1.0, 512: 1.0, 1024: 0.95}, Bf16GemmPlan(True, None)),  # never 10% better
])
def test_the_bf16_gemm_plan_follows_the_timings(torch_over_packed, upcast_over_packed, plan):
    assert _plan_from_timings(torch_over_packed, upcast_over_packed) == plan
    assert _plan_from_timings(torch_over_packed, upcast_over_packed, "pairs").layout == (
        "pairs" if plan.packed else "tiles")


def test_a_kernel_that_ties_at_decode_sizes_is_packed_where_torchs_prefill_gemm_is_slower():
    """An AVX2 CPU has no bf16 dot product: torch's bf16 GEMM is several times slower at a
    prefill's rows than the kernel or widening, while at 1 and 16 rows all read at memory speed."""
    ties, upcast = [1.0, 1.02], {256: 0.6, 512: 0.5, 1024: 0.5}
    assert _plan_from_timings(ties, upcast) == Bf16GemmPlan(False)
    assert _plan_from_timings(ties, upcast, "tiles", {256: 3.0, 512: 4.0, 1024: 4.0}) == (
        Bf16GemmPlan(True, 256))
    assert _plan_from_timings(ties, upcast, "tiles", {256: 1.05, 512: 1.0}) == Bf16GemmPlan(False)
    assert _plan_from_timings([0.9, 1.0], upcast, "tiles", {256: 4.0}) == Bf16GemmPlan(False)


@pytest.mark.parametrize("layout", _layouts())
def test_packed_linear_rows_do_not_depend_on_the_batch(layout):
    torch.manual_seed(1)
    layer = PackedBf16Linear(torch.randn(96, 64).to(torch.bfloat16), None, layout=layout)
    x = torch.randn(13, 64).to(torch.bfloat16)  # 13 rows: 4-row blocks and a 1-row rest
    batched = layer(x)
    for i in (0, 5, 12):
        assert torch.equal(layer(x[i:i + 1])[0], batched[i])


# Gemma 3 270M's and SmolLM2 135M's hidden sizes; output counts that end in a partial tile (an
# odd one), in a partial 4-tile group, and in whole ones.
MODEL_K = [640, 576]
MODEL_N = [77, 1000, 1024]


@pytest.mark.parametrize("layout", _layouts())
@pytest.mark.parametrize("k", MODEL_K)
@pytest.mark.parametrize("n", MODEL_N)
def test_packed_kernels_at_model_widths_match_torch_at_every_row_count(layout, k, n):
    """fp32 outputs within fp32 summation error of the exact product, bf16 outputs within one
    rounding of it, and every row of a batch the bits it has alone (16 rows fill an AMX tile,
    17 and 64 run several row blocks)."""
    torch.manual_seed(k + n)
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    layer = PackedBf16Linear(weight, bias, layout=layout)
    assert layer.layout == layout
    x = torch.randn(64, k).to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double(), bias.double())
    alone = torch.cat([layer.forward_fp32(x[i:i + 1]) for i in range(64)])
    for m in (1, 2, 3, 8, 16, 17, 64):
        fp32 = layer.forward_fp32(x[:m])
        assert fp32.dtype == torch.float32 and fp32.shape == (m, n)
        assert torch.equal(fp32, alone[:m])
        assert (fp32.double() - exact[:m]).abs().max() < 1e-4 * math.sqrt(k)
        bf16 = layer(x[:m])
        assert bf16.dtype == torch.bfloat16
        assert torch.equal(bf16, fp32.to(torch.bfloat16))
        torch.testing.assert_close(bf16.double(), exact[:m], atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("layout", _layouts())
@pytest.mark.parametrize("k, n", [(640, 1000), (2048, 77), (1024, 48)])
def test_prefill_sized_gemms_give_each_row_its_bits_alone(layout, k, n):
    """Prefill-sized calls (several row blocks and row panels, partial ones among them, at the
    model widths' K): every row of 17 .. 600 rows has the bits it has alone, within fp32
    summation error of the exact product."""
    torch.manual_seed(k + n)
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    layer = PackedBf16Linear(weight, bias, layout=layout)
    x = torch.randn(600, k).to(torch.bfloat16)
    alone = {i: layer.forward_fp32(x[i:i + 1]) for i in (0, 15, 16, 17, 31, 40, 511, 512, 599)}
    exact = F.linear(x.double(), weight.double(), bias.double())
    for m in (17, 31, 33, 40, 600):
        fp32 = layer.forward_fp32(x[:m])
        assert (fp32.double() - exact[:m]).abs().max() < 1e-4 * math.sqrt(k)
        assert torch.equal(layer(x[:m]), fp32.to(torch.bfloat16))
        for i, row in alone.items():
            if i < m:
                assert torch.equal(fp32[i:i + 1], row), (m, i)


@pytest.mark.parametrize("layout", _layouts())
def test_fp32_outputs_are_the_unrounded_sums(layout):
    torch.manual_seed(3)
    layer = PackedBf16Linear(torch.randn(40, 64).to(torch.bfloat16), None, layout=layout)
    x = torch.randn(5, 64).to(torch.bfloat16)
    exact = F.linear(x.double(), layer.weight_rows().double())
    fp32 = layer.forward_fp32(x)
    assert fp32.dtype == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-4  # bf16 rounding would be ~1e-2 here
    assert torch.equal(fp32.to(torch.bfloat16), layer(x))  # the same sums, rounded once


@pytest.mark.parametrize("layout", ["tiles", "pairs", "amx"])
def test_packed_rows_are_the_weight_rows(layout):
    weight = torch.randn(37, 64).to(torch.bfloat16)
    ids = torch.tensor([0, 36, 17, 16, 5])
    layer = PackedBf16Linear(weight, None, layout=layout)
    assert torch.equal(layer.rows(ids), weight[ids])
    assert torch.equal(layer.weight_rows(), weight)
    assert pack_weight(weight, layout).shape == {
        "tiles": (3, 64, 16), "pairs": (3, 32, 16, 2), "amx": (3, 2, 16, 16, 2)}[layout]


def test_an_in_features_a_layout_does_not_fit_takes_the_next_simpler_one():
    assert PackedBf16Linear(torch.randn(20, 15).to(torch.bfloat16), None,
                            layout="pairs").layout == "tiles"
    assert PackedBf16Linear(torch.randn(20, 48).to(torch.bfloat16), None,
                            layout="amx").layout == "pairs"  # 48: even, not 32-aligned
    assert PackedBf16Linear(torch.randn(20, 15).to(torch.bfloat16), None,
                            layout="amx").layout == "tiles"
    with pytest.raises(ValueError, match="the pairs layout needs in_features divisible by 2, "
                                         "got 15"):
        pack_weight(torch.randn(20, 15).to(torch.bfloat16), "pairs")
    with pytest.raises(ValueError, match="the amx layout needs in_features divisible by 32, "
                                         "got 48"):
        pack_weight(torch.randn(20, 48).to(torch.bfloat16), "amx")


@pytest.mark.parametrize("value, plan", [
    ("torch", Bf16GemmPlan(False)), ("tiles", Bf16GemmPlan(True, None, "tiles"))])
def test_the_gemm_plan_can_be_forced_without_measuring(monkeypatch, tmp_path, value, plan):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.setenv(PLAN_ENV, value)
    assert bf16_gemm_plan("any-key") == plan
    assert not (tmp_path / "kernels").exists()  # nothing measured, nothing cached
    monkeypatch.setenv(PLAN_ENV, "fastest")
    with pytest.raises(ValueError, match="LLM_FORGE_GEMM_PLAN must be one of auto, torch, tiles, "
                                         "pairs, amx, got 'fastest'"):
        bf16_gemm_plan("any-key")


@pytest.mark.parametrize("level", ["native", "x86-64-v3"])
def test_a_new_machine_measures_its_own_plan(monkeypatch, tmp_path, level):
    """Shape plans are cached per plan key, and the key names the CPU whether the library was
    built for this CPU or for a named level: another CPU never reads this one's plans."""
    from triton_backend.engine.cpu import kernels

    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.MARCH_ENV, level)
    monkeypatch.delenv(PLAN_ENV, raising=False)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: "model name: cpu A\nflags: avx2")
    key_a = kernels.plan_key()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: "model name: cpu B\nflags: avx2 amx")
    assert kernels.plan_key() != key_a
    cached = tmp_path / "kernels" / key_a / "bf16_shape_plans.json"
    cached.parent.mkdir(parents=True)
    cached.write_text('{"64x32": {"version": %d, "plan": {"packed": true, "upcast_min_rows": 512,'
                      ' "layout": "tiles"}}}' % linear.SHAPE_PLAN_VERSION)
    monkeypatch.setattr(linear, "available_layouts", lambda: ("tiles",))
    assert bf16_gemm_plan(key_a).for_shape(32, 64) == Bf16GemmPlan(True, 512, "tiles")
    measured = []
    monkeypatch.setattr(linear, "_measure_layout",
                        lambda layout, weight, k: measured.append(layout) or ([3.0, 2.0], {}, {}))
    assert bf16_gemm_plan(kernels.plan_key()).for_shape(32, 64) == Bf16GemmPlan(True)
    assert measured == ["tiles"]  # B measured anew


def test_a_plan_measured_while_other_processes_used_the_cpus_is_measured_again(monkeypatch,
                                                                              tmp_path):
    """Measured while a build beside it took 60% of the CPUs: measured again at the next
    start; measured on a quiet machine (10%): read from the cache from then on."""
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.delenv(PLAN_ENV, raising=False)
    monkeypatch.setattr(linear, "available_layouts", lambda: ("tiles",))
    measured, shares = [], iter([0.6, 0.1])
    monkeypatch.setattr(linear, "_measure_layout",
                        lambda layout, weight, k: measured.append(layout) or ([3.0, 2.0], {}, {}))

    class Busy:
        def __enter__(self):
            self.share = next(shares)
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(linear, "OthersCpuShare", Busy)
    plan = bf16_gemm_plan("a-key")
    for _ in range(3):
        assert plan.for_shape(40, 64) == Bf16GemmPlan(True)
    assert measured == ["tiles", "tiles"]


def test_the_others_share_is_the_machines_busy_time_less_this_process_over_all_cpu_time(
        monkeypatch):
    machine, own = iter([(10.0, 20.0), (13.0, 24.0)]), iter([5.0, 6.0])
    monkeypatch.setattr(linear, "_machine_cpu_seconds", lambda: next(machine))
    monkeypatch.setattr(linear, "_own_cpu_seconds", lambda: next(own))
    with linear.OthersCpuShare() as busy:
        pass
    assert busy.share == 0.5  # 3 s busy, 1 of them ours, over 4 s of CPU time
    if platform.system() == "Linux":
        monkeypatch.undo()
        busy_s, all_s = linear._machine_cpu_seconds()
        assert 0 < busy_s <= all_s


def test_each_weight_shape_gets_the_kernel_its_own_timings_choose(monkeypatch, tmp_path):
    """A shape where torch's GEMM keeps up stays an nn.Linear while the LM head's shape is
    packed in the layout that won it; each shape is measured once, then read from the cache."""
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.delenv(PLAN_ENV, raising=False)
    monkeypatch.setattr(linear, "available_layouts", lambda: ("tiles", "pairs", "amx"))
    measured = []

    def fake_timings(layout, weight, k):  # torch's time over the kernel's at 1 and 16 rows
        measured.append((tuple(weight.shape), layout))
        if weight.shape[0] == 24:  # the "projection": torch faster at 16 rows
            return [1.0, 0.9], {}, {}
        return {"tiles": [1.5, 0.5], "pairs": [2.5, 0.8], "amx": [2.4, 1.9]}[layout], {}, {}

    monkeypatch.setattr(linear, "_measure_layout", fake_timings)
    plan = bf16_gemm_plan("a-key")
    assert plan.packed and plan.layout == "amx" and plan.measured_in == "a-key"

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 24, bias=False).to(torch.bfloat16)
    model.head = torch.nn.Linear(64, 40, bias=False).to(torch.bfloat16)
    model.lm_head, model.tie_word_embeddings = torch.nn.Linear(64, 8), False
    assert linear.pack_linears(model, plan) == 1
    assert type(model.proj) is torch.nn.Linear
    assert isinstance(model.head, PackedBf16Linear) and model.head.layout == "amx"
    assert len(measured) == 6
    assert plan.for_shape(40, 64) == Bf16GemmPlan(True, None, "amx")  # from the cache
    assert plan.for_shape(24, 64) == Bf16GemmPlan(False)
    assert len(measured) == 6
    # Only layouts a shape fits are measured: in_features 48 is not 32-aligned.
    plan.for_shape(40, 48)
    assert [layout for shape, layout in measured[6:]] == ["tiles", "pairs"]


def _paged_case(dtype, q_lens, ctx_lens, num_heads=6, num_kv_heads=2, head_dim=32, tpb=4):
    """A shuffled block pool, one block table per sequence, their queries packed."""
    g = torch.Generator().manual_seed(7)
    blocks = [-(-n // tpb) for n in ctx_lens]
    pool = torch.randperm(sum(blocks) + 3, generator=g)
    tables, at = [], 0
    for n in blocks:
        tables.append(pool[at:at + n].tolist())
        at += n
    slots = (sum(blocks) + 3) * tpb
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    return tables, k_cache, v_cache, q


def _int32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _padded_tables(tables) -> torch.Tensor:
    """Block tables as the kernel takes them: one int32 row per sequence, zero-padded."""
    width = max(len(t) for t in tables)
    return _int32([t + [0] * (width - len(t)) for t in tables])


# (query heads, kv heads, head_dim): GQA and MHA at the usual widths, then groups the value pass
# splits into runs of four heads (5 = 4 + 1, 8 = 4 + 4) and widths that end in a lone 8-lane
# vector (40) or in scalars (12).
ATTENTION_SHAPES = [(6, 2, 32), (4, 4, 32), (10, 2, 40), (16, 2, 12), (7, 1, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES,
                         ids=["gqa", "mha", "group5-d40", "group8-d12", "group7-d24"])
def test_paged_attention_matches_gathered_sdpa(dtype, shape):
    num_heads, num_kv_heads, head_dim = shape
    q_lens, ctx_lens, tpb, scale = [1, 3, 1, 8], [9, 5, 600, 8], 4, 1 / math.sqrt(head_dim)
    tables, k_cache, v_cache, q = _paged_case(dtype, q_lens, ctx_lens, num_heads, num_kv_heads,
                                              head_dim=head_dim, tpb=tpb)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = torch.ops.llm_forge.paged_attention(
        q, k_cache, v_cache, _padded_tables(tables), _int32(ctx_lens), _int32(starts), tpb,
        scale)
    for b, (n_q, n_ctx) in enumerate(zip(q_lens, ctx_lens)):
        pos = torch.arange(n_ctx)
        slots = torch.tensor(tables[b])[pos // tpb] * tpb + pos % tpb
        ks, vs = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        qs = q[starts[b]:starts[b + 1]].float().transpose(0, 1)
        mask = pos[None, :] <= torch.arange(n_q)[:, None] + n_ctx - n_q
        ref = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                             scale=scale, enable_gqa=True)[0].transpose(0, 1)
        _close(out[starts[b]:starts[b + 1]], ref.to(dtype), dtype)


def test_a_row_of_paged_attention_does_not_depend_on_its_batch():
    tables, k_cache, v_cache, q = _paged_case(torch.float32, [1, 1, 1], [700, 30, 3])
    padded = _padded_tables(tables)
    together = torch.ops.llm_forge.paged_attention(q, k_cache, v_cache, padded,
                                                   _int32([700, 30, 3]), _int32([0, 1, 2, 3]), 4,
                                                   0.2)
    alone = torch.ops.llm_forge.paged_attention(q[:1], k_cache, v_cache, padded[:1],
                                                _int32([700]), _int32([0, 1]), 4, 0.2)
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_give_the_same_attention_whether_their_kv_heads_share_a_work_item(dtype):
    # A step with many (row, part) pairs gives each work item all kv heads of a row (a slot's
    # rows read as one run); alone, a row's heads are separate items. Same numbers either way.
    rows = 4 * torch.get_num_threads() + 2
    ctx = [300 + 37 * i for i in range(rows)]
    tables, k_cache, v_cache, q = _paged_case(dtype, [1] * rows, ctx, num_heads=9,
                                              num_kv_heads=3, head_dim=64, tpb=16)
    padded = _padded_tables(tables)
    together = torch.ops.llm_forge.paged_attention(q, k_cache, v_cache, padded, _int32(ctx),
                                                   _int32(list(range(rows + 1))), 16, 0.125)
    for r in (0, rows - 1):
        alone = torch.ops.llm_forge.paged_attention(q[r:r + 1], k_cache, v_cache,
                                                    padded[r:r + 1], _int32([ctx[r]]),
                                                    _int32([0, 1]), 16, 0.125)
        assert torch.equal(together[r:r + 1], alone)


def _one_byte(x: torch.Tensor, scale: float, kv_dtype: str) -> torch.Tensor:
    """x as a one-byte cache stores it (quant/kv_cache.py): int8, or FP8 bits in uint8."""
    from triton_backend.engine.quant.kv_cache import KV_STORAGE_DTYPES, quantize_kv

    return quantize_kv(x, scale, kv_dtype).view(KV_STORAGE_DTYPES[kv_dtype])


def _widened(stored: torch.Tensor, scale: float, kv_dtype: str) -> torch.Tensor:
    from triton_backend.engine.quant.kv_cache import KV_DTYPES, dequantize_kv

    return dequantize_kv(stored.view(KV_DTYPES[kv_dtype]), scale, torch.float32)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_one_byte_cache_widens_every_stored_byte_exactly(kv_dtype):
    """One key per sequence: the output is its value row as stored, times the value scale. All
    256 byte patterns (FP8's two NaNs excepted: values are clamped to 448), subnormals included."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_dtype == "fp8":
        patterns[(patterns == 0x7F) | (patterns == 0xFF)] = 0
    storage = _one_byte(torch.zeros(1), 1.0, kv_dtype).dtype
    v = patterns.view(storage).reshape(8, 1, 32)
    q = torch.randn(8, 1, 32)
    out = torch.ops.llm_forge.paged_attention(
        q, torch.zeros_like(v), v, _int32([[b] for b in range(8)]), _int32([1] * 8),
        _int32(list(range(9))), 1, 0.1, 0.5, 0.37)
    assert torch.equal(out, _widened(v, 0.37, kv_dtype))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_over_a_one_byte_cache_is_attention_over_its_widened_values(dtype,
                                                                                    kv_dtype):
    num_heads, num_kv_heads, head_dim = 10, 2, 40
    q_lens, ctx_lens, tpb, scale = [1, 3, 1], [9, 5, 600], 4, 1 / math.sqrt(head_dim)
    tables, k_cache, v_cache, q = _paged_case(torch.float32, q_lens, ctx_lens, num_heads,
                                              num_kv_heads, head_dim=head_dim, tpb=tpb)
    k_scale, v_scale = 0.03, 0.02
    k_stored, v_stored = _one_byte(k_cache, k_scale, kv_dtype), _one_byte(v_cache, v_scale, kv_dtype)
    args = (_padded_tables(tables), _int32(ctx_lens), _int32([0, 1, 4, 5]), tpb, scale)
    out = torch.ops.llm_forge.paged_attention(q.to(dtype), k_stored, v_stored, *args, k_scale,
                                              v_scale)
    ref = torch.ops.llm_forge.paged_attention(q.to(dtype).float(),
                                              _widened(k_stored, k_scale, kv_dtype),
                                              _widened(v_stored, v_scale, kv_dtype), *args)
    _close(out, ref.to(dtype), dtype)
    unscaled = torch.ops.llm_forge.paged_attention(q.to(dtype), k_stored, v_stored, *args)
    assert not torch.allclose(unscaled.float(), out.float(), atol=0.1)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_cache_stores_what_the_quantized_cache_writes(dtype, kv_dtype):
    """The kernel's rotary + quantized write against torch's rotary (layers.RotaryEmbedding) and
    QuantizedPagedKVCache.write's quantize_kv: the same bytes."""
    from types import SimpleNamespace

    from triton_backend.engine.layers import RotaryEmbedding

    torch.manual_seed(3)
    heads, kv_heads, d, tokens = 6, 2, 32, 5
    angles = torch.arange(64)[:, None] * torch.rand(d // 2)[None]
    rotary = SimpleNamespace(cos=torch.cat([angles.cos()] * 2, -1),
                             sin=torch.cat([angles.sin()] * 2, -1))
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * d)).to(dtype)
    positions, slots = torch.tensor([0, 7, 8, 40, 63]), torch.tensor([9, 0, 3, 17, 12])
    k_scale, v_scale = 0.04, 0.03
    empty = _one_byte(torch.zeros(20, kv_heads, d), 1.0, kv_dtype)
    k_cache, v_cache = empty.clone(), empty.clone()
    rotated = qkv.clone()
    torch.ops.llm_forge.rope_write_cache(rotated, positions, rotary.cos, rotary.sin, heads,
                                         kv_heads, k_cache, v_cache, slots, k_scale, v_scale)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref, k_ref = RotaryEmbedding.forward(rotary, positions, q.view(tokens, heads, d),
                                           k.view(tokens, kv_heads, d))
    assert torch.equal(rotated[:, :heads * d], q_ref.reshape(tokens, -1))
    assert torch.equal(k_cache[slots], _one_byte(k_ref, k_scale, kv_dtype))
    assert torch.equal(v_cache[slots], _one_byte(v.view(tokens, kv_heads, d), v_scale, kv_dtype))


def test_torch_and_cpp_backends_agree_on_an_engine(tiny_engines, monkeypatch):
    """Same fp32 engine, same prompts: prefill logits within float noise, greedy ids equal."""
    from triton_backend.engine import Request
    from triton_backend.engine import model_runner
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate, prefill_logits

    engine_dir = tiny_engines("llama_gqa")
    prompts = [[5 + i, 9, 13 + 2 * i, 7] * (i + 1) for i in range(4)]
    requests = lambda: [Request(p, 12, ignore_eos=True) for p in prompts]  # noqa: E731
    cpp_ids = [r.output_ids for r in generate(LLMEngine(engine_dir), requests())]
    cpp_logits = prefill_logits(engine_dir, prompts[3])
    assert LLMEngine(engine_dir).runner.ops.name == "cpp"
    monkeypatch.setattr(model_runner, "select_ops", lambda device: TorchOps())
    assert [r.output_ids for r in generate(LLMEngine(engine_dir), requests())] == cpp_ids
    torch.testing.assert_close(prefill_logits(engine_dir, prompts[3]), cpp_logits, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_torch_and_cpp_backends_agree_on_a_one_byte_cache(tiny_engines, tmp_path, monkeypatch,
                                                          kv_dtype):
    """The kernels quantize on write and widen on read where the torch path writes and gathers
    through QuantizedPagedKVCache: on an fp32 engine, the same greedy ids and the same bytes in
    the cache, which the kernels read and the torch path did not."""
    import tiny
    from triton_backend.engine import Request
    from triton_backend.engine import model_runner
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    engine_dir = tiny.one_byte_kv_engine(tiny_engines("llama_gqa"), tmp_path, kv_dtype)
    prompts = [[5 + i, 9, 13 + 2 * i, 7] * (i + 1) for i in range(4)]
    requests = lambda: [Request(p, 12, ignore_eos=True) for p in prompts]  # noqa: E731
    runs = {}
    for name in ("cpp", "torch"):
        if name == "torch":
            monkeypatch.setattr(model_runner, "select_ops", lambda device: TorchOps())
        engine = LLMEngine(engine_dir, enable_prefix_caching=False)
        assert engine.runner.ops.name == name
        assert (getattr(engine.runner.ops, "decode_forward", None) is not None) == (name == "cpp")
        ids = [r.output_ids for r in generate(engine, requests())]
        runs[name] = ids, engine.runner.kv_cache
    assert runs["cpp"][0] == runs["torch"][0]
    (_, cpp_cache), (_, torch_cache) = runs["cpp"], runs["torch"]
    assert cpp_cache.k.dtype in (torch.int8, torch.uint8)
    written = torch_cache.k.ne(0)
    assert written.sum() > 100
    mismatched = cpp_cache.k.ne(torch_cache.k).sum() + cpp_cache.v.ne(torch_cache.v).sum()
    assert mismatched <= 1e-3 * written.sum()


FAST_PATH_PROMPTS = [[5 + i, 9, 13 + 2 * i, 7] * (i + 1) for i in range(4)]


def _fast_and_python_ids(engine_dir):
    """Greedy ids of a few requests (mixed lengths, streamed or not) with the decode fast path,
    then without it; and how many steps the fast path ran."""
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    requests = lambda: [Request(p, 10 + i, streaming=i % 2 == 0, ignore_eos=True)  # noqa: E731
                        for i, p in enumerate(FAST_PATH_PROMPTS)]
    # The second pass must compute what the first did: with the prefix cache it would reuse the
    # first pass's blocks and prefill the rest on another path (equal in fp32, not in bf16).
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    fast = engine.runner.ops.decode_forward
    assert fast is not None and fast.supported
    covered = []
    covers = fast.covers
    fast.covers = lambda meta, rows: covered.append(covers(meta, rows)) or covered[-1]
    with_fast = [r.output_ids for r in generate(engine, requests())]
    engine.runner.ops.decode_forward = None
    without = [r.output_ids for r in generate(engine, requests())]
    return with_fast, without, sum(covered)


@pytest.mark.parametrize("shape, dtype, kv_dtype", [
    ("llama_gqa", "float32", None), ("qwen2_bias_tied", "float32", None),
    ("llama_gqa", "bfloat16", None), ("llama_gqa", "bfloat16", "int8"),
    ("llama_gqa", "float32", "fp8")])
def test_the_decode_fast_path_gives_the_python_models_tokens(tmp_path, shape, dtype, kv_dtype):
    import tiny

    engine_dir = tiny.build_engine(tmp_path, shape, dtype=dtype)
    if kv_dtype is not None:
        engine_dir = tiny.one_byte_kv_engine(engine_dir, tmp_path, kv_dtype)
    with_fast, without, steps = _fast_and_python_ids(engine_dir)
    assert steps > 10 and with_fast == without


def _fast_and_python_log_probs(engine_dir):
    """(ids, log probs) of a few requests with the decode fast path, then without it; and how
    many steps the fast path ran."""
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    prompts = [[5 + i, 9, 13 + 2 * i, 7] * (i + 1) for i in range(3)]
    requests = lambda: [Request(p, 12, ignore_eos=True, return_log_probs=True)  # noqa: E731
                        for p in prompts]
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    fast = engine.runner.ops.decode_forward
    assert fast is not None and fast.supported
    covered = []
    covers = fast.covers
    fast.covers = lambda meta, rows: covered.append(covers(meta, rows)) or covered[-1]
    runs = []
    for _ in range(2):
        runs.append([(r.output_ids, r.log_probs) for r in generate(engine, requests())])
        engine.runner.ops.decode_forward = None
    return runs[0], runs[1], sum(covered)


@pytest.mark.parametrize("shape", ["qwen3_qk_norm", "family:qwen3_moe", "family:mixtral",
                                   "family:gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_fast_path_computes_qk_norm_and_experts_as_the_python_model(tmp_path, shape,
                                                                                dtype):
    """QK-norm (Qwen3), a mixture of experts (Qwen3-MoE with a dense layer, Mixtral) and Gemma 3's
    layer (local layers whose window the requests outgrow) in the one-call path: the Python
    model's tokens and log probs, which the same kernels give."""
    import tiny

    engine_dir = tiny.build_engine(tmp_path, shape, dtype=dtype)
    with_fast, without, steps = _fast_and_python_log_probs(engine_dir)
    assert steps > 10
    assert [ids for ids, _ in with_fast] == [ids for ids, _ in without]
    torch.testing.assert_close([lp for _, lp in with_fast], [lp for _, lp in without],
                               rtol=0, atol=1e-5 if dtype == "float32" else 0)


def test_the_decode_fast_path_runs_only_families_that_declare_it(tmp_path, monkeypatch):
    """Every family's layer is in the C++ step today; a family that says otherwise
    (`fused_decode = False`) takes the Python model."""
    import tiny
    from triton_backend.engine.cpu.forward import DecodeForward
    from triton_backend.engine.families.gemma3 import GEMMA3
    from triton_backend.engine.llm_engine import LLMEngine

    engine_dir = tiny.build_engine(tmp_path, "family:gemma3", dtype="bfloat16")
    for declared in (True, False):
        monkeypatch.setattr(GEMMA3, "fused_decode", declared)
        runner = LLMEngine(engine_dir).runner
        assert DecodeForward(runner.model, runner.kv_cache, torch.bfloat16).supported is declared
        assert runner.ops.decode_forward is not None
        assert runner.ops.decode_forward.supported is declared


def _decode_step_arguments(rows_per_seq, dtype, kv_dtype=None, prefill_from=None,
                           qk_norm=False, gemma=False, bf16_layout="tiles"):
    """decode_forward's arguments for a two-layer Llama layer of made-up weights: per layer the
    projections are INT4 (qkv with an AWQ scale, gate_up with zero points) and bf16 tiles (dense
    with a bias, down), over sequences of 20 + i cached tokens each adding `rows_per_seq[i]` rows;
    the cache in `dtype`, or of one byte per element (`kv_dtype`) with a scale per layer. The
    sequences from `prefill_from` on are the prefill kernel's (after the paged kernel's rows).
    `qk_norm`: each layer norms its q and k heads first (Qwen3). `gemma`: Gemma 3's layer on top
    (QK-norm, the attention's and the MLP's outputs normed, a GELU-tanh gate, the first layer
    local: a window of 8 keys and a rotary table of its own). `bf16_layout`: the bf16 projections'
    packed layout."""
    from triton_backend.engine.quant import int4
    from triton_backend.engine.cpu.quantized import pack_int4_dot

    torch.manual_seed(len(rows_per_seq) * 7 + sum(rows_per_seq))
    layers, hidden, heads, kv_heads, d, inter, block = 2, 64, 4, 2, 16, 96, 16
    shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden),
              (hidden, inter)]
    weights = []
    for _ in range(layers):
        weights += [1 + 0.1 * torch.randn(hidden, dtype=dtype) for _ in range(2)]
        for i, (n, k) in enumerate(shapes):
            w = torch.randn(n, k) / math.sqrt(k)
            if i in (0, 2):
                q, scales, zeros = int4.quantize_rtn_zero_point(w, 32)
                packed, params = pack_int4_dot(q, scales, zeros)
                prequant = 0.5 + torch.rand(k) if i == 0 else None
                weights += [packed, params, prequant, None]
            else:
                weights += [pack_weight(w.bfloat16(), bf16_layout), None, None,
                            torch.randn(n) * 0.1 if i == 1 else None]
    weights.append(1 + 0.1 * torch.randn(hidden, dtype=dtype))
    norm = lambda n: 1 + 0.3 * torch.randn(n, dtype=dtype)  # noqa: E731
    layer_extras = [w for _ in range(layers) for w in (
        norm(d), norm(d), None, None, *((norm(hidden), norm(hidden)) if gemma else (None, None)))
        ] if qk_norm or gemma else []
    cached = [20 + i for i in range(len(rows_per_seq))]
    lens = [c + r for c, r in zip(cached, rows_per_seq)]
    per_seq = max(4, *(-(-n // block) for n in lens))  # blocks of the cache each sequence owns
    tables = [[b * per_seq + j for j in range(-(-n // block))] for b, n in enumerate(lens)]
    positions = [p for c, r in zip(cached, rows_per_seq) for p in range(c, c + r)]
    slots = [tables[b][p // block] * block + p % block
             for b, (c, r) in enumerate(zip(cached, rows_per_seq)) for p in range(c, c + r)]
    starts = [0]
    for r in rows_per_seq:
        starts.append(starts[-1] + r)
    angles = torch.arange(64)[:, None] * torch.rand(d // 2)[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    local = torch.arange(64)[:, None] * torch.rand(d // 2)[None] * 0.3
    num_slots = per_seq * len(lens) * block
    cache = lambda: torch.randn(layers, num_slots, kv_heads, d).to(dtype)  # noqa: E731
    kv_scales = None
    if kv_dtype is not None:
        kv_scales = torch.tensor([[0.02, 0.03], [0.025, 0.015]])
        cache = lambda: _one_byte(torch.randn(layers, num_slots, kv_heads, d),  # noqa: E731
                                  0.02, kv_dtype)
    split = len(lens) if prefill_from is None else prefill_from
    attention = dict(block_tables=_padded_tables(tables[:split] or [[0]])[:split],
                     seq_lens=_int32(lens[:split]), query_start=_int32(starts[:split + 1]))
    if split < len(lens):
        attention.update(prefill_block_tables=_padded_tables(tables[split:]),
                         prefill_seq_lens=_int32(lens[split:]),
                         prefill_query_start=_int32([r - starts[split] for r in starts[split:]]))
    return dict(hidden=torch.randn(len(positions), hidden).to(dtype),
                positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), **attention,
                cos=cos, sin=sin, k_cache=cache(), v_cache=cache(),
                weights=weights, kinds=[1, 0, 1, 0] * layers,
                out_features=[n for n, _ in shapes] * layers, group_sizes=[32, 0, 32, 0] * layers,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=d, tokens_per_block=block,
                eps=1e-5, scale=d ** -0.5, lora=[], lora_runs=[], layer_extras=layer_extras,
                routing=[], kv_scales=kv_scales,
                **(dict(local_cos=torch.cat([local.cos()] * 2, -1),
                        local_sin=torch.cat([local.sin()] * 2, -1), windows=[8, 0], gelu=True)
                   if gemma else {}))


@pytest.mark.parametrize("rows_per_seq, dtype, threads, kv_dtype, prefill_from", [
    *[(rows, dtype, threads, None, None) for rows in ([1], [1, 1, 1], [5, 1], [1] * 9, [12, 1, 3])
      for dtype in DTYPES for threads in (1, 2)],
    *[(rows, dtype, 2, kv, None) for rows in ([1], [1] * 9) for dtype in DTYPES
      for kv in ("int8", "fp8")],
    # Rows of the prefill kernel after the paged kernel's, or alone (a verify step at c=1).
    *[(rows, dtype, threads, None, split) for rows, split in (([1, 1, 5, 12], 2), ([5], 0),
                                                              ([1] * 9 + [3, 24], 9))
      for dtype in DTYPES for threads in (1, 2)],
    *[([1, 1, 6], dtype, 2, kv, 2) for dtype in DTYPES for kv in ("int8", "fp8")],
])
def test_the_one_region_decode_step_computes_the_op_by_op_steps_values(rows_per_seq, dtype,
                                                                       threads, kv_dtype,
                                                                       prefill_from):
    """decode_forward in one parallel region (row phases on one thread below 8 rows, split at 8
    and more) returns the op-by-op path's hidden states and writes its cache, bit for bit; with
    a one-byte cache too, and with rows of the prefill kernel."""
    args = _decode_step_arguments(rows_per_seq, dtype, kv_dtype, prefill_from)
    results = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for single_region in (False, True):
            run = dict(args, hidden=args["hidden"].clone(), k_cache=args["k_cache"].clone(),
                       v_cache=args["v_cache"].clone())
            out = torch.ops.llm_forge.decode_forward(**run, single_region=single_region)
            results.append((out, run["k_cache"], run["v_cache"]))
    finally:
        torch.set_num_threads(previous)
    (out, k, v), (region_out, region_k, region_v) = results
    assert torch.isfinite(out.float()).all() and not torch.equal(k, args["k_cache"])
    assert torch.equal(region_out, out)
    assert torch.equal(region_k, k) and torch.equal(region_v, v)


@pytest.mark.parametrize("rows_per_seq, dtype, prefill_from", [
    *[(rows, dtype, None) for rows in ([1], [1] * 9) for dtype in DTYPES],
    *[([1, 1, 6], dtype, 2) for dtype in DTYPES]])
def test_the_one_region_decode_step_norms_q_and_k_heads_as_the_op_by_op_step(rows_per_seq, dtype,
                                                                             prefill_from):
    """QK-norm in the region: the op-by-op path's values (qk_norm_), bit for bit, and not the
    values without it."""
    args = _decode_step_arguments(rows_per_seq, dtype, None, prefill_from, qk_norm=True)
    results = []
    for single_region, extras in ((False, args["layer_extras"]), (True, args["layer_extras"]),
                                  (True, [])):
        run = dict(args, hidden=args["hidden"].clone(), k_cache=args["k_cache"].clone(),
                   v_cache=args["v_cache"].clone(), layer_extras=extras)
        out = torch.ops.llm_forge.decode_forward(**run, single_region=single_region)
        results.append((out, run["k_cache"]))
    (out, k), (region_out, region_k), (plain_out, plain_k) = results
    assert torch.isfinite(out.float()).all()
    assert torch.equal(region_out, out) and torch.equal(region_k, k)
    assert not torch.equal(plain_out, out) and not torch.equal(plain_k, k)


@pytest.mark.parametrize("layout", ["pairs", "amx"])
@pytest.mark.parametrize("rows_per_seq, prefill_from", [([1], None), ([1] * 9, None),
                                                        ([1, 1, 6], 2), ([3] * 7 + [20], 6)])
def test_the_one_region_decode_step_runs_the_in_place_bf16_layouts_as_the_op_by_op_step(
        rows_per_seq, prefill_from, layout):
    """bf16 projections in the dot-product kernel's pairs and on AMX tiles (the kernels that read
    bf16 rows in place) in the region: the op-by-op path's values, bit for bit. The region takes
    them in bf16, not under an AWQ scale (those steps run op by op)."""
    if layout not in linear.available_layouts():
        pytest.skip(f"this build of the kernels does not run the {layout} layout")
    args = _decode_step_arguments(rows_per_seq, torch.bfloat16, None, prefill_from,
                                  bf16_layout=layout)
    supported = torch.ops.llm_forge.decode_region_supported
    assert supported(args["weights"], args["kinds"], torch.bfloat16)
    assert not supported(args["weights"], args["kinds"], torch.float32)
    scaled = list(args["weights"])
    scaled[2 + 4 + 2] = torch.ones(64)  # an AWQ scale on the first layer's dense (pairs / AMX)
    assert not supported(scaled, args["kinds"], torch.bfloat16)
    assert supported(_decode_step_arguments([1], torch.bfloat16)["weights"], args["kinds"],
                     torch.float32)
    results = []
    for single_region in (False, True):
        run = dict(args, hidden=args["hidden"].clone(), k_cache=args["k_cache"].clone(),
                   v_cache=args["v_cache"].clone())
        results.append((torch.ops.llm_forge.decode_forward(**run, single_region=single_region),
                        run["k_cache"]))
    (out, k), (region_out, region_k) = results
    assert torch.isfinite(out.float()).all()
    assert torch.equal(region_out, out) and torch.equal(region_k, k)


@pytest.mark.parametrize("rows_per_seq, dtype, kv_dtype, prefill_from", [
    *[(rows, dtype, None, None) for rows in ([1], [1] * 9) for dtype in DTYPES],
    *[([1, 1, 6], dtype, kv, 2) for dtype in DTYPES for kv in (None, "int8")]])
def test_the_one_region_decode_step_computes_gemmas_layer_as_the_op_by_op_step(rows_per_seq, dtype,
                                                                               kv_dtype,
                                                                               prefill_from):
    """Gemma 3's layer in the region (output norms, GELU-tanh, a local layer's window and rotary
    table, with rows of the prefill kernel too): the op-by-op path's values, bit for bit; and
    each of its parts changes them (the window, since every sequence holds more than 8 keys)."""
    args = _decode_step_arguments(rows_per_seq, dtype, kv_dtype, prefill_from, gemma=True)
    extras = args["layer_extras"]
    no_out_norms = [None if i % 6 >= 4 else w for i, w in enumerate(extras)]
    variants = [dict(), dict(single_region=False), dict(gelu=False), dict(windows=[]),
                dict(local_cos=None, local_sin=None), dict(layer_extras=no_out_norms)]
    results = []
    for variant in variants:
        run = dict(args, hidden=args["hidden"].clone(), k_cache=args["k_cache"].clone(),
                   v_cache=args["v_cache"].clone(), **variant)
        results.append(torch.ops.llm_forge.decode_forward(**run))
    region, op_by_op, *others = results
    assert torch.isfinite(region.float()).all()
    assert torch.equal(region, op_by_op)
    for variant, out in zip(variants[2:], others):
        assert not torch.equal(out, region), variant


def test_a_cache_the_kernels_cannot_read_is_refused_with_its_dtype_named():
    tables, k_cache, v_cache, q = _paged_case(torch.float32, [1], [9])
    with pytest.raises(RuntimeError, match=r"the cache holds Half: it must hold the activations' "
                                           r"dtype \(Float\), int8 or FP8 e4m3 \(as uint8\)"):
        torch.ops.llm_forge.paged_attention(q, k_cache.half(), v_cache.half(),
                                            _padded_tables(tables), _int32([9]), _int32([0, 1]),
                                            4, 0.2)
    args = _decode_step_arguments([1], torch.float32, "int8")
    with pytest.raises(RuntimeError, match=r"a one-byte cache needs kv_scales, \[2, 2\] fp32"):
        torch.ops.llm_forge.decode_forward(**dict(args, kv_scales=None))


def test_the_kernels_can_be_built_for_a_lower_instruction_set(monkeypatch):
    """LLM_FORGE_KERNEL_MARCH builds the code paths of another CPU (make test runs the kernel
    tests again with x86-64-v3: AVX2, no AVX-512); each choice is a build of its own."""
    from triton_backend.engine.cpu import kernels

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("LLM_FORGE_KERNEL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in kernels.cflags() and "-march=native" not in kernels.cflags()
    capped = kernels.build_key()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.delenv("LLM_FORGE_KERNEL_MARCH")
    assert kernels.build_key() != capped
    monkeypatch.setenv("LLM_FORGE_KERNEL_MARCH", "-O0 -fevil")
    with pytest.raises(ValueError, match="LLM_FORGE_KERNEL_MARCH must be one of native, "
                                         "x86-64-v2, x86-64-v3, x86-64-v4, got '-O0 -fevil'"):
        kernels.cflags()


def test_the_plan_timings_are_not_decided_by_a_burst_of_load(monkeypatch):
    """Candidates are timed in turns and each by its fastest run: load that falls on some runs
    (here 5 extra units on every other call of the faster candidate, 3 on the first rounds of
    the other) leaves each candidate's own cost, so the ratio and the plan stay as unloaded."""
    clock = {"now": 0.0}
    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock["now"])
    calls = {"fast": 0, "slow": 0}

    def run(name, cost, burst):
        def fn():
            calls[name] += 1
            clock["now"] += cost + burst(calls[name])
        return fn

    fast = run("fast", 1.0, lambda n: 5.0 if n % 2 else 0.0)
    slow = run("slow", 3.0, lambda n: 3.0 if n < 4 else 0.0)
    ours, theirs = linear.best_times([fast, slow], 7)
    assert (ours, theirs) == (1.0, 3.0)
    assert linear._plan_from_timings([theirs / ours, theirs / ours], {}) == Bf16GemmPlan(True)

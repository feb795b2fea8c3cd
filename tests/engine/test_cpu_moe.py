"""The fused CPU mixture-of-experts kernel (`cpu/moe.py`, csrc/moe.cpp) against the per-expert
reference (`SparseMoE.grouped`): fp32 tightly, bf16 bit for bit where the reference's experts run
the same packed GEMM, within bf16 rounding against torch's own; rows independent of the step's
row count; and tiny Qwen3-MoE and Mixtral engines greedy-identical to transformers with it on."""
import pytest
import torch

import tiny
from triton_backend.engine.config import EngineConfig, Limits, ModelShape
from triton_backend.engine.cpu import moe as cpu_moe
from triton_backend.engine.cpu.kernels import load_cpu_kernels
from triton_backend.engine.cpu.linear import PackedBf16Linear
from triton_backend.engine.moe import SparseMoE
from triton_backend.engine.cpu.ops import CppOps

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the CPU kernels cannot be built")

HIDDEN, INTERMEDIATE = 64, 48
ROWS = (1, 3, 17, 64)
# (architecture, norm_topk_prob): qwen3_moe renormalises when its config says so, mixtral always.
FAMILIES = (("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True))


def _layouts() -> list[str]:
    return ["tiles", "pairs"] if torch.ops.llm_forge.moe_pairs_available() else ["tiles"]


def _moe(dtype: torch.dtype, top_k: int = 2, experts: int = 8, architecture: str = "qwen3_moe",
         renormalise: bool = True, seed: int = 0) -> SparseMoE:
    shape = ModelShape(architecture=architecture, vocab_size=32, hidden_size=HIDDEN,
                       intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=INTERMEDIATE,
                       norm_topk_prob=renormalise)
    config = EngineConfig(name="moe", target="torch", dtype="float32", model=shape,
                          limits=Limits(max_batch_size=1, max_num_tokens=64, max_input_len=64,
                                        max_seq_len=128))
    torch.manual_seed(seed)
    moe = SparseMoE(config, 0)
    for p in moe.parameters():
        p.normal_(std=0.3)
    return moe.to(dtype)


def _pack_experts_like_the_linears(moe: SparseMoE, layout: str) -> None:
    """The experts' projections on the packed bf16 GEMM of `layout` (what pack_linears does)."""
    for expert in moe.experts:
        for name in ("gate_up", "proj"):
            linear = getattr(expert, name)
            setattr(expert, name, PackedBf16Linear(linear.weight.data, None, layout=layout))


def _rows(count: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("architecture,renormalise", FAMILIES)
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("rows", ROWS)
def test_fp32_matches_the_per_expert_path(architecture, renormalise, top_k, rows):
    moe = _moe(torch.float32, top_k, architecture=architecture, renormalise=renormalise)
    assert cpu_moe.prepare_moe(moe) == 1 and moe.packed_experts.layout == "tiles"
    x = _rows(rows, torch.float32)
    assert cpu_moe.covers(moe, x)
    torch.testing.assert_close(cpu_moe.sparse_moe(moe, x), moe.grouped(x, CppOps()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", _layouts())
@pytest.mark.parametrize("architecture,renormalise", FAMILIES)
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_is_the_per_expert_path_on_the_same_packed_gemm_bit_for_bit(
        layout, architecture, renormalise, top_k, rows):
    moe = _moe(torch.bfloat16, top_k, architecture=architecture, renormalise=renormalise)
    _pack_experts_like_the_linears(moe, layout)
    assert cpu_moe.prepare_moe(moe, layout) == 1 and moe.packed_experts.layout == layout
    x = _rows(rows, torch.bfloat16)
    assert torch.equal(cpu_moe.sparse_moe(moe, x), moe.grouped(x, CppOps()))


@pytest.mark.parametrize("layout", _layouts())
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_is_within_bf16_rounding_of_torchs_gemm(layout, rows):
    moe = _moe(torch.bfloat16)
    x = _rows(rows, torch.bfloat16)
    theirs = moe.grouped(x, CppOps()).float()  # the experts as nn.Linear: torch's GEMM
    cpu_moe.prepare_moe(moe, layout)
    ours = cpu_moe.sparse_moe(moe, x).float()
    # A few bf16 roundings (gate_up, SiLU, down, the weight, the sum) of values around 10.
    torch.testing.assert_close(ours, theirs, rtol=0.03, atol=0.1)


@pytest.mark.parametrize("layout", _layouts())
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(layout):
    """n sampled choices of one request must equal single requests: each row is computed the
    same way whatever the step's row count."""
    moe = _moe(torch.bfloat16, top_k=2)
    cpu_moe.prepare_moe(moe, layout)
    x = _rows(64, torch.bfloat16)
    together = cpu_moe.sparse_moe(moe, x)
    for count in (1, 2, 5, 17):
        assert torch.equal(cpu_moe.sparse_moe(moe, x[:count]), together[:count])


def test_a_bf16_layers_experts_are_held_once_as_views_of_the_stacks():
    moe = _moe(torch.bfloat16)
    x = _rows(5, torch.bfloat16)
    cpu_moe.prepare_moe(moe, "tiles")
    stack = moe.packed_experts.gate_up
    for j, expert in enumerate(moe.experts):
        assert expert.gate_up.packed.data_ptr() == stack[j].data_ptr()
        assert expert.proj.packed.data_ptr() == moe.packed_experts.down[j].data_ptr()
    assert torch.equal(cpu_moe.sparse_moe(moe, x), moe.grouped(x, CppOps()))


def test_experts_no_row_chose_are_skipped_and_every_row_to_one_expert_is_summed_once():
    """A router that sends every row to experts 2 and 5: the six others get no rows."""
    moe = _moe(torch.float32, top_k=2, experts=8)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
        moe.router.weight[5] = 0.5
    x = _rows(17, torch.float32).abs()  # positive rows: experts 2 and 5 score highest
    cpu_moe.prepare_moe(moe)
    expected = moe.grouped(x, CppOps())
    torch.testing.assert_close(cpu_moe.sparse_moe(moe, x), expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().sum() > 0


def test_uncovered_experts_keep_the_per_expert_path():
    moe = _moe(torch.float32)
    moe.experts[3].silu = False  # a GELU expert: not the kernel's
    assert cpu_moe.prepare_moe(moe) == 0 and not cpu_moe.covers(moe, _rows(1, torch.float32))
    bf16 = _moe(torch.bfloat16)
    cpu_moe.prepare_moe(bf16, "tiles")
    assert not cpu_moe.covers(bf16, _rows(1, torch.float32))  # rows in another dtype


def test_a_step_of_no_rows_is_empty():
    moe = _moe(torch.float32)
    cpu_moe.prepare_moe(moe)
    assert cpu_moe.sparse_moe(moe, _rows(0, torch.float32)).shape == (0, HIDDEN)


@pytest.fixture(scope="module")
def families_built(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(shape):
        if shape not in cache:
            tmp = tmp_path_factory.mktemp(shape.replace(":", "-"))
            engine = tiny.build_engine(tmp, shape)
            hf = AutoModelForCausalLM.from_pretrained(
                str(tmp / f"hf-{shape.replace(':', '-')}"), dtype=torch.float32).eval()
            cache[shape] = engine, hf
        return cache[shape]
    return get


@pytest.mark.parametrize("shape", ["family:qwen3_moe", "family:mixtral"])
def test_engines_with_the_fused_path_are_greedy_identical_to_transformers(
        families_built, shape, monkeypatch):
    import lora_helpers
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine

    engine_dir, hf = families_built(shape)
    engine = LLMEngine(engine_dir)  # the CPU backend stacks the experts at load
    assert any(getattr(m, "packed_experts", None) is not None
               for m in engine.runner.model.modules())
    calls = []
    fused = cpu_moe.sparse_moe
    monkeypatch.setattr(cpu_moe, "sparse_moe", lambda moe, x: calls.append(len(x)) or fused(moe, x))
    one_call = engine.runner.ops.decode_forward  # decode steps: the experts from C++
    assert one_call is not None and one_call.supported
    engine.runner.ops.decode_forward = lambda ids, *args: calls.append(len(ids)) or one_call(
        ids, *args)
    engine.runner.ops.decode_forward.covers = one_call.covers
    prompts = [list(range(100, 190, 3)), [5, 9, 13, 17], list(range(2, 60))]
    ids = [engine.add_request(Request(p, 16, ignore_eos=True)) for p in prompts]
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for response in engine.step():
            assert response.error is None, response.error
            outputs[response.request_id].extend(response.output_token_ids)
    assert calls and 3 in calls  # decode steps of the three rows took the fused kernel
    for prompt, i in zip(prompts, ids):
        assert outputs[i] == lora_helpers.hf_greedy(hf, prompt, 16)


def test_int4_experts_keep_the_per_expert_path(tmp_path):
    """INT4 experts (the zero-point quantizer covers them) are not the fused kernel's: their
    layers stay on the per-expert path, which still generates."""
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine

    engine_dir = tiny.build_engine(tmp_path, "family:qwen3_moe", dtype="bfloat16", quantization={
        "weights": "int4_rtn", "zero_point": True, "group_size": 16,
        "quality": {"min_top1_agreement": 0.0, "min_logit_cosine": 0.0,
                    "max_perplexity_increase_pct": None}})
    engine = LLMEngine(engine_dir)
    assert cpu_moe.prepare_moe(engine.runner.model) == 0
    engine.add_request(Request([5, 9, 13, 17], 4, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for response in engine.step():
            assert response.error is None, response.error
            tokens.extend(response.output_token_ids)
    assert len(tokens) == 4

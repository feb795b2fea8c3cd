"""The mixture-of-experts MLP: routing and grouping against a per-token reference, INT4 experts
through our own quantizer, and LoRA on experts refused at build time."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import lora_helpers
import tiny
from builder.cli import main
from triton_backend.engine.config import EngineConfig, Limits, ModelShape
from triton_backend.engine.moe import SparseMoE, route
from triton_backend.engine.offline import prefill_logits
from triton_backend.engine.ops import TorchOps


def _moe(renormalise: bool, top_k: int = 2, experts: int = 6) -> SparseMoE:
    shape = ModelShape(architecture="qwen3_moe", vocab_size=32, hidden_size=16,
                       intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=8, num_experts=experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=12,
                       norm_topk_prob=renormalise)
    config = EngineConfig(name="moe", target="torch", dtype="float32", model=shape,
                          limits=Limits(max_batch_size=1, max_num_tokens=8, max_input_len=8,
                                        max_seq_len=16))
    torch.manual_seed(0)
    moe = SparseMoE(config, 0)
    for p in moe.parameters():
        p.normal_(std=0.5)
    return moe


@pytest.mark.parametrize("renormalise", [True, False])
def test_each_token_is_the_weighted_sum_of_its_top_k_experts(renormalise):
    moe, ops = _moe(renormalise), TorchOps()
    x = torch.randn(9, 16)
    logits = x @ moe.router.weight.T
    expected = torch.zeros_like(x)
    for t in range(len(x)):
        probs = torch.softmax(logits[t], dim=-1)
        top = torch.topk(probs, 2)
        weights = top.values / top.values.sum() if renormalise else top.values
        for w, e in zip(weights, top.indices):
            expected[t] += w * moe.experts[int(e)](x[t:t + 1], ops)[0]
    torch.testing.assert_close(moe(x, ops), expected, atol=1e-5, rtol=1e-5)


def test_routing_keeps_the_top_k_and_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    weights, experts = route(logits, 2, renormalise=False)
    probs = torch.softmax(logits, dim=-1)[0]
    assert experts.tolist() == [[0, 2]]
    torch.testing.assert_close(weights[0], probs[[0, 2]])
    weights, _ = route(logits, 2, renormalise=True)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))


def test_an_expert_no_token_chose_reads_no_weights():
    """At one token a step only the routed experts run: the rest are never called."""
    moe, ops = _moe(True, top_k=2, experts=8), TorchOps()
    called = set()
    for j, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, j=j: called.add(j))
    moe(torch.randn(1, 16), ops)
    assert len(called) == 2


def test_int4_experts_are_quantized_and_the_router_is_not(tmp_path):
    base = tiny.build_engine(tmp_path / "fp32", "family:qwen3_moe")
    int4 = tiny.build_engine(tmp_path / "int4", "family:qwen3_moe", dtype="bfloat16",
                             quantization={"weights": "int4_rtn", "zero_point": True,
                                           "group_size": 16,
                                           # a random checkpoint at 4 bits: loose thresholds
                                           "quality": {"min_top1_agreement": 0.3,
                                                       "min_logit_cosine": 0.5,
                                                       "max_perplexity_increase_pct": None}})
    state = load_file(str(int4 / "model.safetensors"))
    expert = "transformer.layers.0.mlp.experts.5.gate_up"
    assert state[f"{expert}.weight"].dtype == torch.int8  # two nibbles a byte
    assert state[f"{expert}.weight"].numel() * 2 == 64 * 64  # [2 x 32, hidden 64] in nibbles
    assert f"{expert}.weights_scaling_factor" in state and f"{expert}.zero" in state
    assert state["transformer.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    assert "transformer.layers.1.mlp.gate_up.weights_scaling_factor" in state  # the dense layer
    ids = list(range(2, 60))
    ours, reference = prefill_logits(int4, ids), prefill_logits(base, ids)
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.4, agree  # a random checkpoint at 4 bits; the gate is for real models


def test_lora_on_experts_is_refused_at_build_time(tmp_path):
    hf_dir = tiny.make_checkpoint(tmp_path / "hf", "family:qwen3_moe")
    adapter = lora_helpers.train_adapter(hf_dir, tmp_path / "peft", ["q_proj"], r=4, alpha=8,
                                         seed=1, steps=2)
    experts = lora_helpers.copy_adapter(adapter, tmp_path / "peft-experts",
                                        {"target_modules": ["q_proj", "gate_proj"]})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "name": "moe-lora", "checkpoint": str(hf_dir), "dtype": "float32",
        "output": str(tmp_path / "engine"), "lora": {"adapters": {"experts": str(experts)}},
        "limits": {"max_batch_size": 2, "max_num_tokens": 64, "max_input_len": 64,
                   "max_seq_len": 128}, "kv_cache": {"tokens_per_block": 8, "num_blocks": 32}}))
    result = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository"])
    assert result.exit_code == 2, result.output
    assert ("module gate_proj: LoRA on it is not supported (supported: ['k_proj', 'o_proj', "
            "'q_proj', 'v_proj'])") in " ".join(result.output.split())
    assert not (tmp_path / "engine").exists()


def test_the_decode_roofline_counts_the_active_experts_only(tmp_path):
    """A c=1 decode reads top_k of num_experts experts a layer: the roofline's bytes are the
    dense weights and 2/8 of the experts' (qwen3_moe's example: 8 experts, top 2)."""
    from builder.bench.roofline import decode_weight_bytes
    from triton_backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny.build_engine(tmp_path, "family:qwen3_moe"))
    model = engine.runner.model
    tensors = dict(model.named_parameters())
    experts = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n)
    dense = sum(t.numel() * t.element_size() for n, t in tensors.items()
                if ".experts." not in n and "vocab_embedding" not in n)
    assert experts > dense  # the experts are most of the bytes
    assert decode_weight_bytes(model) == int(dense + experts * 2 / 8)

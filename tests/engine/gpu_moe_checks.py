"""The fused mixture-of-experts kernels (triton_backend/engine/gpu/moe.py) against the runtime's
SparseMoE (the torch reference), run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set
by tests/engine/test_gpu_moe.py, which starts this script in a process of its own)."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter"

from triton_backend.engine.config import EngineConfig, Limits, ModelShape  # noqa: E402
from triton_backend.engine.gpu.moe import align_by_expert, fused_moe  # noqa: E402
from triton_backend.engine.moe import SparseMoE, route  # noqa: E402
from triton_backend.engine.ops import TorchOps  # noqa: E402


def _moe(experts: int, top_k: int, act: str, renormalise: bool) -> SparseMoE:
    shape = ModelShape(architecture="qwen3_moe", vocab_size=32, hidden_size=48,
                       intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=24, hidden_act=act, num_experts=experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=40,
                       norm_topk_prob=renormalise)
    config = EngineConfig(name="moe", target="torch", dtype="float32", model=shape,
                          limits=Limits(max_batch_size=1, max_num_tokens=8, max_input_len=8,
                                        max_seq_len=16))
    torch.manual_seed(experts * 10 + top_k)
    moe = SparseMoE(config, 0)
    for p in moe.parameters():
        p.normal_(std=0.3)
    return moe


def check_alignment() -> None:
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3]])
    sorted_ids, block_expert = align_by_expert(experts, num_experts=5, block_m=4)
    pairs = experts.numel()
    blocks = sorted_ids.view(-1, 4)
    for block, expert in zip(blocks, block_expert.tolist()):
        real = [int(p) for p in block if p < pairs]
        assert all(int(experts.flatten()[p]) == expert for p in real), (block, expert)
    assert sorted(int(p) for p in sorted_ids if p < pairs) == list(range(pairs))
    assert 2 not in block_expert[:3].tolist() and 4 not in block_expert[:3].tolist()
    print("alignment: every pair once, each block one expert's")


def check_against_sparse_moe(experts: int, top_k: int, tokens: int, act: str,
                             renormalise: bool, dtype: torch.dtype) -> None:
    moe = _moe(experts, top_k, act, renormalise).to(dtype)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    reference = moe(x, TorchOps())
    weights, chosen = route(moe.router(x), top_k, renormalise)
    gate_up = torch.stack([e.gate_up.weight for e in moe.experts])
    proj = torch.stack([e.proj.weight for e in moe.experts])
    ours = fused_moe(x, gate_up, proj, weights, chosen, silu=act == "silu")
    diff = (ours.float() - reference.float()).abs().max().item()
    # bf16: both round the intermediate and the outputs, in other places (a few steps of 2^-8)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * reference.float().abs().max().item()
    assert diff <= tolerance, (experts, top_k, tokens, act, dtype, diff, tolerance)
    print(f"fused moe {experts} experts top-{top_k} {tokens} tokens {act} {dtype}: "
          f"max |kernel - reference| {diff:.2e}")


def check_engine(engine_dir: str) -> None:
    """A mixture-of-experts engine on the GPU backend (its kernels interpreted): greedy ids equal
    transformers' (prompts of one decode and of a prefill over every expert)."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lora_helpers
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    engine = LLMEngine(engine_dir)
    assert engine.runner.ops.name == "gpu", engine.runner.ops.name
    hf = AutoModelForCausalLM.from_pretrained(str(Path(engine_dir).parent / Path(
        engine_dir).name.replace("engine-", "hf-")), dtype=torch.float32).eval()
    prompts = [list(range(3, 40)), [5, 9, 13]]
    ours = generate(engine, [Request(p, 12, ignore_eos=True) for p in prompts])
    for prompt, result in zip(prompts, ours):
        assert result.output_ids == lora_helpers.hf_greedy(hf, prompt, 12), prompt
    layers = engine.runner.model.transformer.layers
    assert all(getattr(layer.mlp, "_stacked", None) is not None for layer in layers), \
        "the steps did not take the fused kernels"
    print(f"engine on the fused experts: greedy equal to transformers for {len(prompts)} prompts")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        check_engine(sys.argv[1])
        sys.exit(0)
    check_alignment()
    for experts, top_k, tokens, act, renormalise, dtype in [
            (8, 2, 1, "silu", True, torch.float32),      # a decode: two experts' weights
            (8, 2, 37, "silu", False, torch.float32),    # a prefill chunk over every expert
            (16, 4, 9, "gelu_pytorch_tanh", True, torch.float32),
            (6, 1, 20, "silu", True, torch.bfloat16)]:
        check_against_sparse_moe(experts, top_k, tokens, act, renormalise, dtype)

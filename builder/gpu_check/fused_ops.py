"""The GPU backend's fused kernels held to the torch ops they replace, on the device itself:
RMSNorm with and without the residual add, SiLU * up, rotary with the KV-cache write, and the
FP8 input quantization, at the largest shape's sizes in bf16.

The kernels round where the torch ops round, so the two agree up to what neither rounding point
controls: the order a row's squares are summed in (RMSNorm) and the GPU's fast exp (SiLU). Each
can move the first rounded value by one bf16 step, rarely, which the weight's product (up to
1.5 here) can carry to two steps of the result. So the check asks at most two steps (of the
value's magnitude) apart everywhere and the FP8 bytes equal, and reports how many elements are
identical. Where no kernel runs (a CPU without Triton: the backend runs the torch ops
themselves) it is reported, not applied.
"""
from __future__ import annotations

import torch

MAX_STEPS = 2.0  # bf16 steps of the value's magnitude


def _steps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None
           ) -> tuple[float, float]:
    """(the largest difference in bf16 steps, the share of identical elements)."""
    size = (expected if magnitude is None else magnitude).float().abs().clamp(min=1e-3)
    spacing = torch.finfo(torch.bfloat16).eps * size
    steps = float(((got.float() - expected.float()).abs() / spacing).max())
    same = float((got.view(torch.int16) == expected.view(torch.int16)).float().mean()) \
        if got.dtype == torch.bfloat16 else float((got == expected).float().mean())
    return steps, same


def fused_cases(shape, device: str) -> dict[str, tuple[float, float]]:
    """Per fused op: (the largest difference in bf16 steps, the share of identical elements)."""
    from triton_backend.engine.config import ModelShape
    from triton_backend.engine.gpu import fused
    from triton_backend.engine.gpu.fp8 import quantize_fp8, quantize_fp8_reference
    from triton_backend.engine.layers import RotaryEmbedding
    from triton_backend.engine.ops import TorchOps

    g = torch.Generator(device=device).manual_seed(0)
    rows, hidden = 64, shape.hidden_size
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    head_dim = hidden // heads

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(torch.bfloat16)

    ops, out = TorchOps(), {}
    x, residual = randn(rows, hidden), randn(rows, hidden)
    weight = (torch.rand(hidden, generator=g, device=device) + 0.5).to(torch.bfloat16)
    got, got_residual = fused.add_rms_norm(x, residual, weight, 1e-5)
    want, want_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    out["add_rms_norm"] = max(_steps(got, want), _steps(got_residual, want_residual))
    out["rms_norm"] = _steps(fused.add_rms_norm(x, None, weight, 1e-5)[0],
                             ops.rms_norm(x, weight, 1e-5))
    gate_up = randn(rows, 2 * shape.intermediate_size)
    out["silu_mul"] = _steps(fused.silu_mul(gate_up), ops.silu_mul(gate_up))
    model_shape = ModelShape("LlamaForCausalLM", shape.vocab_size, hidden,
                             shape.intermediate_size, 1, heads, kv_heads, head_dim)
    rotary = RotaryEmbedding(model_shape, 2048, device)
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 2048, (rows,), generator=g, device=device)
    cache = [torch.zeros(rows, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
             for _ in range(2)]
    slots = torch.arange(rows, device=device)
    q, k = fused.rope_write_cache(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads,
                                  head_dim, *cache, slots, 1.0, 1.0, 0)
    q_want, k_want = rotary(positions, qkv[:, :heads * head_dim].view(rows, heads, head_dim),
                            qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
                            .view(rows, kv_heads, head_dim))
    # A rotated value may cancel to near zero: its steps are those of its inputs' magnitude.
    size = qkv.float().abs().view(rows, -1, head_dim).amax(-1, keepdim=True)
    q_size, k_size = size[:, :heads], size[:, heads:heads + kv_heads]
    out["rope_write_cache"] = max(_steps(q, q_want, q_size.expand_as(q)),
                                  _steps(k, k_want, k_size.expand_as(k)),
                                  _steps(cache[0], k_want, k_size.expand_as(k)))
    scale = torch.tensor(4.0 / 448, device=device)
    fp8 = quantize_fp8(x, scale), quantize_fp8_reference(x, scale)
    out["quantize_fp8"] = (0.0 if torch.equal(fp8[0].view(torch.uint8), fp8[1].view(torch.uint8))
                           else float("inf"), float((fp8[0].float() == fp8[1].float())
                                                    .float().mean()))
    return out


def check_fused_ops(shape, settings, report) -> None:
    from triton_backend.engine.gpu.triton_support import available

    if settings.device != "cuda" or not available():
        report.extra["fused_ops"] = {"skipped": "no Triton kernel runs here: the backend runs "
                                                "the torch ops themselves"}
        report.check("fused ops = torch ops on the device", True, "references ran",
                     f"<= {MAX_STEPS:g} bf16 steps", applied=False)
        return
    cases = fused_cases(shape, settings.device)
    report.extra["fused_ops"] = {name: {"max_bf16_steps": steps, "identical": same}
                                 for name, (steps, same) in cases.items()}
    worst = max(steps for steps, _ in cases.values())
    report.check("fused ops = torch ops on the device", worst <= MAX_STEPS,
                 f"max {worst:g} steps, identical "
                 f"{min(same for _, same in cases.values()):.4%} or more",
                 f"<= {MAX_STEPS:g} bf16 steps")

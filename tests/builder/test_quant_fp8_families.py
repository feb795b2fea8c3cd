"""FP8 weights by our own quantizer for the families ModelOpt's export refuses (Gemma 3, Mixtral,
Qwen3-MoE): every projection (each expert's too) in float8 with per-row scales and an activation
scale our runtime measured, the router untouched, logits near the unquantized engine's."""
import json

import pytest
import torch
from safetensors.torch import load_file

import tiny
from builder.quantize.fp8 import FP8_MAX, activation_amax, expert_kind, quantize_weight
from triton_backend.engine.offline import prefill_logits

FP8_QUALITY = {"min_top1_agreement": 0.5, "min_logit_cosine": 0.9,
               "max_perplexity_increase_pct": None}  # random weights: the gate is for real models
CALIBRATION = {"samples": 4, "seq_len": 32, "batch_size": 2}


def test_weights_take_one_scale_per_output_row():
    torch.manual_seed(0)
    w = torch.randn(6, 32) * torch.tensor([1e-3, 1e-2, 0.1, 1.0, 10.0, 0.0])[:, None]
    q, scales = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6,)
    assert torch.equal(q.float().abs().amax(1)[:5], torch.full((5,), FP8_MAX))  # each row's range
    back = q.float() * scales[:, None]
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-30).all()  # e4m3: 3 mantissa bits
    assert torch.equal(back[5], torch.zeros(32))


def test_an_expert_no_calibration_row_reached_borrows_its_layers_largest():
    modules = ["transformer.layers.0.attention.qkv", "transformer.layers.0.mlp.experts.0.gate_up",
               "transformer.layers.0.mlp.experts.1.gate_up", "transformer.layers.0.mlp.experts.1.proj",
               "transformer.layers.1.mlp.experts.0.proj"]
    measured = {"transformer.layers.0.attention.qkv": 3.0,
                "transformer.layers.0.mlp.experts.0.gate_up": 5.0,
                "transformer.layers.0.mlp.experts.1.proj": 7.0}
    amax, borrowed = activation_amax(modules, measured)
    assert amax == {"transformer.layers.0.attention.qkv": 3.0,
                    "transformer.layers.0.mlp.experts.0.gate_up": 5.0,
                    "transformer.layers.0.mlp.experts.1.gate_up": 5.0,  # its sibling's
                    "transformer.layers.0.mlp.experts.1.proj": 7.0,
                    "transformer.layers.1.mlp.experts.0.proj": FP8_MAX}  # none seen: scale 1
    assert borrowed == 2
    assert expert_kind("transformer.layers.3.mlp.experts.12.proj") == "transformer.layers.3.mlp.experts.*.proj"
    assert expert_kind("transformer.layers.3.mlp.gate_up") is None


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "mixtral"])
def test_fp8_engines_of_the_families_modelopt_refuses(tmp_path, family):
    base = tiny.build_engine(tmp_path / "fp32", f"family:{family}")
    fp8 = tiny.build_engine(tmp_path / "fp8", f"family:{family}", dtype="bfloat16",
                            quantization={"weights": "fp8", "calibration": CALIBRATION,
                                          "quality": FP8_QUALITY})
    state = load_file(str(fp8 / "model.safetensors"))
    scaled = sorted(key.rpartition(".")[0] for key in state if key.endswith(".weights_scaling_factor"))
    assert "transformer.layers.0.attention.qkv" in scaled and "lm_head" not in scaled
    for module in scaled:
        weight = state[f"{module}.weight"]
        assert weight.dtype == torch.float8_e4m3fn, module
        assert state[f"{module}.weights_scaling_factor"].shape == (weight.shape[0],), module
        act = state[f"{module}.activation_scaling_factor"]
        assert act.shape == (1,) and 0 < float(act) < float("inf"), module
    if family != "gemma3":
        assert "transformer.layers.0.mlp.experts.0.gate_up" in scaled
        assert state["transformer.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    extra = json.loads((fp8 / "config.json").read_text())["extra"]["quantization"]
    assert extra["tool"] == "llm-forge" and extra["quant_algo"] == "FP8"
    if family == "gemma3":  # every dense projection met the calibration rows itself
        assert extra["activation_scales_borrowed"] == 0
    ids = list(range(2, 60))
    ours, reference = prefill_logits(fp8, ids), prefill_logits(base, ids)
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.7, agree

"""The trtllm target's checkpoints of Gemma 3, Mixtral and Qwen3-MoE, pinned against what
TensorRT-LLM 1.2's TensorRT backend reads (docs/trtllm-families.md; the config fields and their
sources in tests/data/trtllm_families.json): config.json, every tensor's name, shape and dtype per
rank at tp 1 and at a split, and the values where a layout choice shows (the fused experts'
up/gate order, Gemma's 1 + w norms, which heads and experts a rank holds)."""
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import tiny
from builder.pipeline.convert import load_hf_state_dict
from builder.pipeline.engine_builder import build_engine
from builder.spec.load import spec_from_dict

EXPECTED = json.loads((Path(__file__).parents[1] / "data" / "trtllm_families.json").read_text())
LIMITS = {"max_batch_size": 4, "max_num_tokens": 64, "max_input_len": 32, "max_seq_len": 64}
CASES = [("gemma3", {}), ("gemma3", {"tp": 2}), ("gemma3", {"pp": 2}), ("mixtral", {}),
         ("mixtral", {"tp": 2, "moe_ep": 2}), ("mixtral", {"tp": 2}),
         ("mixtral", {"tp": 4, "moe_ep": 4}), ("qwen3_moe", {}),
         ("qwen3_moe", {"tp": 2, "moe_ep": 2})]


def qwen3_moe_all_experts(out_dir: Path) -> Path:
    """tiny's Qwen3-MoE with experts in every layer (TensorRT-LLM's Qwen builds no dense one)."""
    import transformers

    out_dir.mkdir(parents=True)
    config = tiny._hf_config("family:qwen3_moe", tiny.make_tokenizer(out_dir))
    config.mlp_only_layers = []
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"gemma3": tiny.make_checkpoint(root / "gemma3", "family:gemma3"),
            "mixtral": tiny.make_checkpoint(root / "mixtral", "family:mixtral"),
            "qwen3_moe": qwen3_moe_all_experts(root / "qwen3_moe")}


@pytest.fixture(scope="module")
def built(checkpoints, tmp_path_factory):
    """family, parallelism -> (engine dir, HF state dict); each case built once."""
    engines: dict = {}

    def get(family: str, parallelism: dict):
        key = (family, tuple(sorted(parallelism.items())))
        if key not in engines:
            out = tmp_path_factory.mktemp(family) / "engine"
            spec = spec_from_dict({"name": "t", "checkpoint": str(checkpoints[family]),
                                   "target": "trtllm", "hardware": "l4", "dtype": "bfloat16",
                                   "output": str(out), "parallelism": parallelism,
                                   "limits": LIMITS})
            engines[key] = build_engine(spec, console=Console(quiet=True), emit_repository=False)
        return engines[key], load_hf_state_dict(checkpoints[family])
    return get


def expected_rank(family: str, config: dict, tp_rank: int, pp_rank: int) -> dict[str, tuple]:
    """name -> shape of one rank, from TensorRT-LLM's converters (source next to each rule)."""
    m = config["mapping"]
    tp, pp = m["tp_size"], m["pp_size"]
    h, v, d = config["hidden_size"], config["vocab_size"], config["head_size"]
    q, kv = config["num_attention_heads"] // tp, max(config["num_key_value_heads"] // tp, 1)
    out: dict[str, tuple] = {}
    if pp_rank == 0:  # gemma/convert.py: split on dim 0 when use_parallel_embedding
        out["transformer.vocab_embedding.weight"] = (v // tp if family == "gemma3" and tp > 1
                                                     else v, h)
    if pp_rank == pp - 1:  # models/*/model.py: lm_head ColumnLinear over pad_vocab_size(v, tp)
        out["lm_head.weight"] = (-(-v // tp), h)
        out["transformer.ln_f.weight"] = (h,)
    layers = torch.tensor_split(torch.arange(config["num_hidden_layers"]), pp)[pp_rank]
    for i in layers.tolist():  # mapping.py pp_layers
        p = f"transformer.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_layernorm.weight": (h,),
                    # llama/convert.py split_qkv_tp: this rank's q, k, v heads (kv duplicated
                    # when tp exceeds them); dense is a RowLinear (split on columns)
                    p + "attention.qkv.weight": ((q + 2 * kv) * d, h),
                    p + "attention.dense.weight": (h, q * d)})
        if family in ("gemma3", "qwen3_moe"):  # Attention(qk_layernorm=True): one per head dim
            out.update({p + "attention.q_layernorm.weight": (d,),
                        p + "attention.k_layernorm.weight": (d,)})
        if family == "gemma3":  # gemma/convert.py: fc = gate_proj, gate = up_proj, proj = down
            inter = config["intermediate_size"] // tp
            out.update({p + "pre_feedforward_layernorm.weight": (h,),
                        p + "post_feedforward_layernorm.weight": (h,),
                        p + "mlp.fc.weight": (inter, h), p + "mlp.gate.weight": (inter, h),
                        p + "mlp.proj.weight": (h, inter)})
        else:  # llama/convert.py, qwen/convert.py: experts stacked, w3w1 fused, router whole
            experts = config["moe"]["num_experts"] // m["moe_ep_size"]
            inter = config.get("moe_intermediate_size", config["intermediate_size"])
            inter //= m["moe_tp_size"]
            out.update({p + "mlp.router.weight": (config["moe"]["num_experts"], h),
                        p + "mlp.fc.weight": (experts, 2 * inter, h),
                        p + "mlp.proj.weight": (experts, h, inter)})
    return out


@pytest.mark.parametrize("family, parallelism", CASES)
def test_checkpoint_config_and_every_tensor_per_rank(built, family, parallelism):
    engine, _ = built(family, parallelism)
    ckpt = engine / "trtllm_checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    tp, pp = parallelism.get("tp", 1), parallelism.get("pp", 1)
    want = dict(EXPECTED["families"][family]["config"])
    want["mapping"] = {**want["mapping"], "world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    if family != "gemma3":
        moe_ep = parallelism.get("moe_ep", 1)
        want["mapping"].update(moe_ep_size=moe_ep, moe_tp_size=tp // moe_ep)
    want["use_parallel_embedding"] = family == "gemma3" and tp > 1
    assert {k: config.get(k) for k in want} == want
    assert sorted(p.name for p in ckpt.glob("rank*.safetensors")) == \
        [f"rank{r}.safetensors" for r in range(tp * pp)]
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            tensors = load_file(str(ckpt / f"rank{pp_rank * tp + tp_rank}.safetensors"))
            assert {k: tuple(t.shape) for k, t in tensors.items()} == \
                expected_rank(family, config, tp_rank, pp_rank)
            assert {k for k, t in tensors.items() if t.dtype != torch.bfloat16} == \
                {k for k in tensors if k.endswith("mlp.router.weight")}  # routed in float32
            assert all(tensors[k].dtype == torch.float32 for k in tensors
                       if k.endswith("mlp.router.weight"))


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def test_gemma3_norms_are_stored_as_one_plus_w_and_tp_splits_heads_and_vocabulary(built):
    engine, hf = built("gemma3", {"tp": 2})
    rank1 = load_file(str(engine / "trtllm_checkpoint" / "rank1.safetensors"))
    layer, ours = "model.layers.2.", "transformer.layers.2."
    # gemma/convert.py load_gemma_weights: every norm (q_norm / k_norm too) gets param + 1.0
    for theirs, mine in [("input_layernorm", "input_layernorm"),
                         ("post_attention_layernorm", "post_layernorm"),
                         ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
                         ("post_feedforward_layernorm", "post_feedforward_layernorm"),
                         ("self_attn.q_norm", "attention.q_layernorm"),
                         ("self_attn.k_norm", "attention.k_layernorm")]:
        assert torch.equal(rank1[f"{ours}{mine}.weight"], bf16(hf[f"{layer}{theirs}.weight"] + 1))
    assert torch.equal(rank1["transformer.ln_f.weight"], bf16(hf["model.norm.weight"] + 1))
    # the embedding stays unscaled (GemmaModel multiplies by sqrt(hidden)); rank 1: rows 192..
    assert torch.equal(rank1["transformer.vocab_embedding.weight"],
                       bf16(hf["model.embed_tokens.weight"][192:]))
    # one KV head, two ranks: both keep it beside their own two q heads
    q, k, v = (hf[f"{layer}self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(rank1[f"{ours}attention.qkv.weight"], bf16(torch.cat([q[32:], k, v])))
    assert torch.equal(rank1[f"{ours}mlp.fc.weight"], bf16(hf[f"{layer}mlp.gate_proj.weight"][64:]))
    assert torch.equal(rank1[f"{ours}mlp.gate.weight"], bf16(hf[f"{layer}mlp.up_proj.weight"][64:]))
    assert torch.equal(rank1[f"{ours}mlp.proj.weight"],
                       bf16(hf[f"{layer}mlp.down_proj.weight"][:, 64:]))


EXPERT_NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1",
                            "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
                "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                              "mlp.experts.{e}.down_proj")}


@pytest.mark.parametrize("family, parallelism, rank, experts, rows", [
    # moe_ep 2: rank 1 is moe_ep_rank 1 (tp_rank % moe_ep_size), experts 4..7 whole
    ("mixtral", {"tp": 2, "moe_ep": 2}, 1, range(4, 8), slice(None)),
    ("qwen3_moe", {"tp": 2, "moe_ep": 2}, 1, range(4, 8), slice(None)),
    # moe_tp 2: rank 1 holds every expert's second half of the intermediate size
    ("mixtral", {"tp": 2}, 1, range(8), slice(24, 48)),
])
def test_fused_experts_are_up_then_gate_split_as_the_mapping_says(built, family, parallelism,
                                                                  rank, experts, rows):
    engine, hf = built(family, parallelism)
    tensors = load_file(str(engine / "trtllm_checkpoint" / f"rank{rank}.safetensors"))
    router, gate, up, down = (f"model.layers.0.{n}.weight" for n in EXPERT_NAMES[family])
    ours = "transformer.layers.0.mlp."
    assert torch.equal(tensors[ours + "router.weight"], hf[router].float())
    for j, e in enumerate(experts):
        # llama/convert.py, qwen/convert.py: torch.concat([w3, w1], dim=-2), w3 = up
        want = torch.cat([hf[up.format(e=e)][rows], hf[gate.format(e=e)][rows]])
        assert torch.equal(tensors[ours + "fc.weight"][j], bf16(want))
        assert torch.equal(tensors[ours + "proj.weight"][j], bf16(hf[down.format(e=e)][:, rows]))


def test_kv_heads_fewer_than_ranks_are_duplicated_to_the_ranks_whose_q_heads_read_them(built):
    engine, hf = built("mixtral", {"tp": 4, "moe_ep": 4})
    rank3 = load_file(str(engine / "trtllm_checkpoint" / "rank3.safetensors"))
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    # llama/convert.py dup_kv_weight: 2 KV heads over 4 ranks -> k0 k0 k1 k1; rank 3: q head 3
    want = torch.cat([q[48:64], k[16:32], v[16:32]])
    assert torch.equal(rank3["transformer.layers.1.attention.qkv.weight"], bf16(want))


def test_plan_records_the_expert_split_and_gemma3_windows(built):
    from triton_backend.engine.config import EngineConfig

    mixtral = EngineConfig.load(built("mixtral", {"tp": 2, "moe_ep": 2})[0]).extra["trtllm"]
    assert (mixtral["moe_tp"], mixtral["moe_ep"], mixtral["checkpoint_writer"]) == (1, 2,
                                                                                    "llm-forge")
    assert "--moe_plugin bfloat16" in mixtral["command"]
    gemma_dir = built("gemma3", {})[0]
    gemma = EngineConfig.load(gemma_dir).extra["trtllm"]
    assert gemma["max_attention_window"] == [24, 24, 64] and "moe_tp" not in gemma
    assert "--moe_plugin" not in gemma["command"]
    from builder.repository.emit import emit_repository

    repo = emit_repository(gemma_dir, gemma_dir.parent / "repo-gemma3")
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert ('key: "max_attention_window_size" value: { string_value: "24,24,64" }'
            in config)

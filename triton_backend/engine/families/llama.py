"""The Llama family: Llama (GQA/MHA, rope scaling), Mistral (full attention) and Qwen2 (QKV bias).

The runtime layout uses TensorRT-LLM's names with fused projections: q/k/v become
`attention.qkv`, gate/up become `mlp.gate_up` (see triton_backend/engine/model.py).
`LlamaFamily.layer_weights` / `model_weights` are the one table of HF -> runtime names;
conversion, ModelOpt's quantization and LoRA's projection tables (`lora_parts`) read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triton_backend.engine.config import EngineConfig, ModelShape

# Tensors a checkpoint may hold that are not weights (older transformers saved rotary tables).
_NOT_WEIGHTS = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Weight:
    """One runtime module and the HF modules it is made of, concatenated along the output dim in
    this order. `bias`: the `ModelShape` flag that says the module has a bias (None: never)."""

    runtime: str
    hf: tuple[str, ...]
    bias: str | None = None


PROJECTIONS = ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.proj")


class LlamaFamily:
    """A pre-norm decoder with fused QKV and gate/up projections, SiLU gating and RoPE."""

    # Per layer, under `model.layers.{i}.` (HF) and `transformer.layers.{i}.` (runtime).
    layer_weights: tuple[Weight, ...] = (
        Weight("input_layernorm", ("input_layernorm",)),
        Weight("attention.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "attention_bias"),
        Weight("attention.dense", ("self_attn.o_proj",)),
        Weight("post_layernorm", ("post_attention_layernorm",)),
        Weight("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"), "mlp_bias"),
        Weight("mlp.proj", ("mlp.down_proj",), "mlp_bias"),
    )
    model_weights: tuple[Weight, ...] = (
        Weight("transformer.vocab_embedding", ("model.embed_tokens",)),
        Weight("transformer.ln_f", ("model.norm",)),
    )
    # The C++ one-call decode path (kernels/forward.py) computes exactly this family's layers.
    fused_decode = True

    def __init__(self, name: str, model_types: tuple[str, ...], qkv_bias: bool = False,
                 sliding_window_by_default: bool = False) -> None:
        self.name, self.model_types = name, model_types
        self.qkv_bias = qkv_bias  # the default when config.json has no `attention_bias`
        self.sliding_window_by_default = sliding_window_by_default

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # -- checkpoint -> shape -------------------------------------------------------------------
    def shape_from_hf(self, hf_config: dict) -> ModelShape:
        """The model shape from an HF `config.json` (transformers 4.x or 5.x rope fields)."""
        heads = hf_config["num_attention_heads"]
        rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if hf_config.get("sliding_window") and hf_config.get("use_sliding_window",
                                                             self.sliding_window_by_default):
            window = hf_config["sliding_window"]
            if window < hf_config.get("max_position_embeddings", 2048):
                raise ValueError(f"checkpoint: sliding_window={window} attention is not supported")
        return ModelShape(
            architecture=self.name,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_hidden_layers=hf_config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=bool(hf_config.get("attention_bias", self.qkv_bias)),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            hidden_act=hf_config.get("hidden_act", "silu"),
        )

    # -- weight names ----------------------------------------------------------------------------
    def weight_map(self, shape: ModelShape) -> dict[str, tuple[str, ...]]:
        """Runtime tensor name -> the HF tensors it concatenates, for every tensor of `shape`."""
        table: dict[str, tuple[str, ...]] = {}

        def add(runtime: str, hf_prefix: str, weight: Weight) -> None:
            table[f"{runtime}.weight"] = tuple(f"{hf_prefix}{p}.weight" for p in weight.hf)
            if weight.bias and getattr(shape, weight.bias):
                table[f"{runtime}.bias"] = tuple(f"{hf_prefix}{p}.bias" for p in weight.hf)

        for weight in self.model_weights:
            add(weight.runtime, "", weight)
        for i in range(shape.num_hidden_layers):
            for weight in self.layer_weights:
                add(f"transformer.layers.{i}.{weight.runtime}", f"model.layers.{i}.", weight)
        if not shape.tie_word_embeddings:
            table["lm_head.weight"] = ("lm_head.weight",)
        return table

    def runtime_name(self, hf_module: str) -> str | None:
        """`model.layers.3.mlp.up_proj` -> `transformer.layers.3.mlp.gate_up`; `lm_head` ->
        `lm_head`; None for a module that is not a projection."""
        if hf_module == "lm_head":
            return "lm_head"
        parts = hf_module.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            return None
        suffix = ".".join(parts[3:])
        for weight in self.layer_weights:
            if weight.runtime in PROJECTIONS and suffix in weight.hf:
                return f"transformer.layers.{parts[2]}.{weight.runtime}"
        return None

    def lora_parts(self) -> list[tuple[str, str, str, int]]:
        """(HF parent, HF projection, runtime projection, part index inside the fused projection)
        of every projection LoRA may adapt, e.g. ("self_attn", "k_proj", "attention.qkv", 1)."""
        return [(*hf.split("."), weight.runtime, index) for weight in self.layer_weights
                if weight.runtime in PROJECTIONS for index, hf in enumerate(weight.hf)]

    def fused_input_groups(self) -> list[tuple[str, ...]]:
        """HF projections of one layer that read the same input and run as one fused GEMM."""
        return [w.hf for w in self.layer_weights if w.runtime in PROJECTIONS and len(w.hf) > 1]

    def convert_state_dict(self, hf_state: dict[str, torch.Tensor], shape: ModelShape,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Rename and fuse HF weights into the runtime layout, cast to `dtype`. A checkpoint
        tensor the family does not read is an error: it would be silently ignored otherwise
        (e.g. a family with extra norms converted as plain Llama)."""
        def take(name: str) -> torch.Tensor:
            if name not in hf_state:
                raise ValueError(f"checkpoint: weight {name!r} is missing")
            return hf_state[name].to(dtype)

        table = self.weight_map(shape)
        out = {ours: torch.cat([take(n) for n in theirs], dim=0) if len(theirs) > 1
               else take(theirs[0]) for ours, theirs in table.items()}
        used = {n for theirs in table.values() for n in theirs}
        if shape.tie_word_embeddings:
            used.add("lm_head.weight")  # some checkpoints save the tied head anyway
        unused = sorted(n for n in hf_state if n not in used and not n.endswith(_NOT_WEIGHTS))
        if unused:
            raise ValueError(f"checkpoint: {len(unused)} weight(s) the {self.name} family does "
                             f"not read, e.g. {unused[:3]}; is config.json's model_type right?")
        return {k: v.contiguous() for k, v in out.items()}

    def parameter_count(self, shape: ModelShape) -> int:
        """Weights of the runtime model (embedding, layers, final norm, untied lm_head, biases),
        counted on the module tree itself, built without memory."""
        from triton_backend.engine.config import Limits

        config = EngineConfig(name="count", target="torch", dtype="float32", model=shape,
                              limits=Limits(max_batch_size=1, max_num_tokens=1, max_input_len=1,
                                            max_seq_len=2))
        with torch.device("meta"):
            return sum(p.numel() for p in self.build(config).parameters())

    # -- the runtime model -----------------------------------------------------------------------
    def attention_class(self) -> type[nn.Module]:
        from triton_backend.engine.model import Attention

        return Attention

    def build(self, config: EngineConfig) -> nn.Module:
        """The runtime model for `config` (parameters uninitialised; `weights.load_model` fills)."""
        from triton_backend.engine.model import CausalLM

        return CausalLM(config, attention=self.attention_class())


LLAMA = LlamaFamily("llama", ("llama",))
MISTRAL = LlamaFamily("mistral", ("mistral",), sliding_window_by_default=True)
QWEN2 = LlamaFamily("qwen2", ("qwen2",), qkv_bias=True)
FAMILIES = (LLAMA, MISTRAL, QWEN2)

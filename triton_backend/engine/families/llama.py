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
from triton_backend.engine.numbers import is_int

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


def _required(hf_config: dict, name: str):
    if name not in hf_config:
        raise ValueError(f"checkpoint: config.json has no {name!r}")
    return hf_config[name]


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
    # The C++ one-call decode path (cpu/forward.py) computes exactly this family's layers.
    fused_decode = True

    def __init__(self, name: str, model_types: tuple[str, ...], qkv_bias: bool = False,
                 sliding_window_by_default: bool = False, example: dict | None = None) -> None:
        self.name, self.model_types = name, model_types
        self.qkv_bias = qkv_bias  # the default when config.json has no `attention_bias`
        self.sliding_window_by_default = sliding_window_by_default
        # The family's distinctive fields in a small HF config (`model_types[0]`'s), beside the
        # generic small sizes: what the family contract test builds a random checkpoint from.
        self.example = dict(example or {})

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # -- checkpoint -> shape -------------------------------------------------------------------
    def shape_from_hf(self, hf_config: dict) -> ModelShape:
        """The model shape from an HF `config.json` (transformers 4.x or 5.x rope fields)."""
        return ModelShape(**self.shape_fields(hf_config))

    def shape_fields(self, hf_config: dict) -> dict:
        """`ModelShape`'s fields read off an HF config (a family adds its own to these)."""
        heads = _required(hf_config, "num_attention_heads")
        hidden = _required(hf_config, "hidden_size")
        rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        if isinstance(rope.get("full_attention"), dict):  # per layer type (transformers 5)
            rope = dict(rope["full_attention"])
        rope_theta = rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        head_dim = hf_config.get("head_dim")
        if not head_dim and is_int(heads) and is_int(hidden) and heads > 0 and hidden % heads:
            raise ValueError(f"checkpoint: hidden_size ({hidden}) is not a multiple of "
                             f"num_attention_heads ({heads}) and config.json gives no head_dim")
        layer_types, window = self._attention_layers(hf_config)
        return dict(
            architecture=self.name,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=_required(hf_config, "intermediate_size"),
            num_hidden_layers=_required(hf_config, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=head_dim or (hidden // heads if is_int(hidden) and is_int(heads)
                                  and heads > 0 else 0),
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=bool(hf_config.get("attention_bias", self.qkv_bias)),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            hidden_act=hf_config.get("hidden_act", "silu"),
            layer_types=layer_types,
            sliding_window=window,
        )

    def _attention_layers(self, hf_config: dict) -> tuple[list[str] | None, int | None]:
        """(layer_types, sliding_window), both None when every layer attends globally. A config
        without `layer_types` slides every layer when it has a window in use (Mistral's
        `sliding_window`, Qwen2's `use_sliding_window`)."""
        types, window = hf_config.get("layer_types"), hf_config.get("sliding_window")
        if types is None and window is not None and hf_config.get(
                "use_sliding_window", self.sliding_window_by_default):
            types = ["sliding_attention"] * hf_config["num_hidden_layers"]
        if not isinstance(types, list) or len(types) != hf_config.get("num_hidden_layers"):
            return types, window  # None, or a pattern ModelShape refuses by name
        return (types, window) if "sliding_attention" in types else (None, None)

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
            for weight in self.layer_weights_of(shape, i):
                add(f"transformer.layers.{i}.{weight.runtime}", f"model.layers.{i}.", weight)
        if not shape.tie_word_embeddings:
            table["lm_head.weight"] = ("lm_head.weight",)
        return table

    def layer_weights_of(self, shape: ModelShape, layer: int) -> tuple[Weight, ...]:
        """Layer `layer`'s table (a mixture-of-experts family swaps the MLP's for its experts')."""
        return self.layer_weights

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
            tensor = hf_state[name]
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"checkpoint: weight {name!r} has NaN or Inf values")
            return tensor.to(dtype)

        table = self.weight_map(shape)
        out = {}
        for ours, theirs in table.items():
            parts = [take(n) for n in theirs]
            if len({tuple(p.shape[1:]) for p in parts}) > 1:
                raise ValueError(f"checkpoint: {' + '.join(theirs)} have shapes "
                                 f"{[list(p.shape) for p in parts]}, which do not stack into "
                                 f"{ours}")
            out[ours] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        used = {n for theirs in table.values() for n in theirs}
        if shape.tie_word_embeddings:
            used.add("lm_head.weight")  # some checkpoints save the tied head anyway
        unused = sorted(n for n in hf_state if n not in used and not n.endswith(_NOT_WEIGHTS))
        if unused:
            raise ValueError(f"checkpoint: {len(unused)} weight(s) the {self.name} family does "
                             f"not read, e.g. {unused[:3]}; is config.json's model_type right?")
        self._check_shapes(out, table, shape)
        return {k: v.contiguous() for k, v in out.items()}

    def _check_shapes(self, state: dict[str, torch.Tensor], table: dict[str, tuple[str, ...]],
                      shape: ModelShape) -> None:
        """Every tensor has the shape config.json implies (a misshapen one is named)."""
        expected = {name: tuple(p.shape) for name, p in self._meta_model(shape).state_dict().items()}
        for name, tensor in state.items():
            if name in expected and tuple(tensor.shape) != expected[name]:
                raise ValueError(f"checkpoint: {' + '.join(table[name])} has shape "
                                 f"{list(tensor.shape)}, config.json implies {list(expected[name])}")

    def parameter_count(self, shape: ModelShape) -> int:
        """Weights of the runtime model (embedding, layers, final norm, untied lm_head, biases),
        counted on the module tree itself, built without memory."""
        return sum(p.numel() for p in self._meta_model(shape).parameters())

    def _meta_model(self, shape: ModelShape) -> nn.Module:
        """The runtime module tree of `shape` without memory."""
        from triton_backend.engine.config import Limits

        config = EngineConfig(name="count", target="torch", dtype="float32", model=shape,
                              limits=Limits(max_batch_size=1, max_num_tokens=1, max_input_len=1,
                                            max_seq_len=2))
        with torch.device("meta"):
            return self.build(config)

    # -- the runtime model -----------------------------------------------------------------------
    def attention_class(self) -> type[nn.Module]:
        from triton_backend.engine.model import Attention

        return Attention

    def build(self, config: EngineConfig) -> nn.Module:
        """The runtime model for `config` (parameters uninitialised; `weights.load_model` fills)."""
        from triton_backend.engine.model import CausalLM

        return CausalLM(config, attention=self.attention_class())


LLAMA = LlamaFamily("llama", ("llama",), example=dict(num_key_value_heads=2))
MISTRAL = LlamaFamily("mistral", ("mistral",), sliding_window_by_default=True,
                      example=dict(num_key_value_heads=1, sliding_window=24))
QWEN2 = LlamaFamily("qwen2", ("qwen2",), qkv_bias=True,
                    example=dict(num_key_value_heads=2, tie_word_embeddings=True))
FAMILIES = (LLAMA, MISTRAL, QWEN2)

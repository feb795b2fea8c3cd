"""Which model families TensorRT-LLM 1.2's TensorRT backend (`trtllm-build`) builds, and the
checkpoint `config.json` each needs; what it cannot build is refused before any work.

What is read from NVIDIA/TensorRT-LLM (the 1.2 line; read, not copied; docs/trtllm-families.md):
- `tensorrt_llm/models/__init__.py` MODEL_MAP: `Gemma3ForCausalLM` -> GemmaForCausalLM,
  `MixtralForCausalLM` -> LLaMAForCausalLM, `Qwen3MoeForCausalLM` -> QWenForCausalLM. The
  checkpoint's `architecture` picks the class `trtllm-build` builds.
- `tensorrt_llm/models/gemma/config.py` + `models/modeling_utils.py` Gemma3ConfigGroup: Gemma 3
  reads `query_pre_attn_scalar`, `final_logit_softcapping`, `_sliding_window_pattern`,
  `rope_local_base_freq`, `sliding_window`; `models/gemma/model.py`: layer i is local when
  (i + 1) % _sliding_window_pattern != 0, with the local rotary base; q_scaling =
  sqrt(query_pre_attn_scalar / head_size); QK-norm; the embedding scaled by sqrt(hidden) in the
  graph (so stored unscaled); tp > 1 forces a vocabulary-parallel embedding.
- `tensorrt_llm/layers/attention.py` create_attention_const_params: the local rotary table
  (`rope_local_base_freq`) gets the same `rotary_scaling` as the global one, so a Gemma 3 whose
  checkpoint scales only its global layers (linear, factor 8 from 4B up) is refused.
- `tensorrt_llm/models/llama/config.py`: Mixtral is `hidden_act` "swiglu" with
  normalization_mode RENORMALIZE; `models/qwen/config.py`: `qwen_type` "qwen3_moe", "swiglu",
  `moe_intermediate_size`, no attention bias; `models/qwen/model.py`: MOE in every layer (no dense
  layers), QK-norm for qwen3 types.
- `tensorrt_llm/layers/moe.py` MoeConfig: `moe` = {num_experts, shared_expert_intermediate_size,
  top_k, normalization_mode}, ExpertScaleNormalizationMode NONE=0, RENORMALIZE=1,
  SPARSE_MIXER=2, DEVICE_LIMITED=3, DEVICE_LIMITED_RENORM=4.
- `tensorrt_llm/mapping.py`: `moe_tp_size` * `moe_ep_size` == tp_size; moe_tp_rank =
  tp_rank // moe_ep_size, moe_ep_rank = tp_rank % moe_ep_size; `ep_experts` gives a rank the
  contiguous block of num_experts / moe_ep_size experts.

TensorRT-LLM's own Qwen3-MoE converter writes normalization_mode NONE whatever the checkpoint's
`norm_topk_prob`; this writer records the checkpoint's (RENORMALIZE when the kept routing weights
are renormalised), which is what the model computes.
"""
from __future__ import annotations

from triton_backend.engine.config import ModelShape

# Our families written by our own checkpoint writer (ModelOpt's exporter refuses them) -> the
# architecture TensorRT-LLM's MODEL_MAP builds them as.
OWN_WRITER = {"gemma3": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}
# Written by ModelOpt's exporter (builder/quantize/trtllm_checkpoint.py).
MODELOPT_WRITER = ("llama", "mistral", "qwen2", "qwen3")
RENORMALIZE, NONE = 1, 0  # MoeConfig.ExpertScaleNormalizationMode


def uses_own_writer(shape: ModelShape) -> bool:
    return shape.architecture in OWN_WRITER


def sliding_window_pattern(shape: ModelShape) -> int | None:
    """The `_sliding_window_pattern` p with layer i global iff (i + 1) % p == 0 that gives the
    shape's layer types (n + 1 when every layer is local); None when no p does."""
    types = shape.layer_types or ["full_attention"] * shape.num_hidden_layers
    layers = len(types)
    for pattern in range(1, layers + 2):
        if all((t == "full_attention") == ((i + 1) % pattern == 0) for i, t in enumerate(types)):
            return pattern
    return None


def check_buildable(shape: ModelShape, spec) -> None:
    """Raise ValueError naming the field when trtllm-build of TensorRT-LLM 1.2 cannot build
    `shape` as `spec` asks (checked before any work, --dry-run included)."""
    name = shape.architecture
    if name not in OWN_WRITER and name not in MODELOPT_WRITER:
        raise ValueError(f"checkpoint: target trtllm cannot build model_type {name} with "
                         f"TensorRT-LLM 1.2's trtllm-build (its TensorRT backend has no such "
                         f"model); use target torch")
    moe = shape.num_experts > 0
    if spec.parallelism.moe_set and not moe:
        raise ValueError(f"parallelism.moe_tp / moe_ep: the {name} model has no experts to split")
    if not uses_own_writer(shape):
        return
    for key in ("weights", "kv_cache"):
        if getattr(spec.quantization, key) != "none":
            raise ValueError(f"quantization.{key}: target trtllm writes the {name} checkpoint "
                             f"unquantized only (ModelOpt's exporter cannot export {name}); "
                             f"use none, or target torch")
    if moe:
        _check_experts(shape, spec)
    if name == "gemma3":
        _check_gemma3(shape, spec)
    elif shape.sliding_window is not None:
        raise ValueError(f"checkpoint: sliding_window {shape.sliding_window}: TensorRT-LLM 1.2's "
                         f"{OWN_WRITER[name]} engine attends globally; use target torch")


def _check_experts(shape: ModelShape, spec) -> None:
    moe_tp, moe_ep = spec.parallelism.moe_split
    if shape.dense_layers:
        raise ValueError(f"checkpoint: layers {shape.dense_layers} have a dense MLP "
                         f"(mlp_only_layers / decoder_sparse_step); TensorRT-LLM 1.2's "
                         f"{OWN_WRITER[shape.architecture]} puts experts in every layer")
    if shape.num_experts % moe_ep:
        raise ValueError(f"parallelism.moe_ep ({moe_ep}) must divide the model's "
                         f"{shape.num_experts} experts")
    if shape.moe_intermediate_size % moe_tp:
        raise ValueError(f"parallelism.moe_tp ({moe_tp}) must divide the experts' intermediate "
                         f"size {shape.moe_intermediate_size}")
    if spec.lora is not None:
        raise ValueError(f"lora: TensorRT-LLM's LoRA on a mixture-of-experts model "
                         f"({shape.architecture}) is not wired up here; use target torch, whose "
                         f"adapters cover the attention")


def _check_gemma3(shape: ModelShape, spec) -> None:
    tp = spec.parallelism.tp
    if sliding_window_pattern(shape) is None:
        raise ValueError(f"checkpoint: layer_types {shape.layer_types} is not every n-th layer "
                         f"global, the only interleaving TensorRT-LLM 1.2's Gemma 3 builds "
                         f"(_sliding_window_pattern)")
    scaling = _rotary_scaling(shape)
    if scaling is not None:  # layers/attention.py applies one scaling to both rotary tables
        raise ValueError(f"checkpoint: rope_scaling {scaling}: TensorRT-LLM 1.2's Gemma 3 would "
                         f"scale its local layers' rotary base too (the checkpoint scales the "
                         f"global ones only); use target torch")
    if shape.vocab_size % tp:  # Gemma's embedding is split over tp ranks
        raise ValueError(f"parallelism.tp ({tp}) must divide the Gemma 3 vocabulary "
                         f"({shape.vocab_size}): TensorRT-LLM splits its embedding over tp")
    if shape.intermediate_size % tp:
        raise ValueError(f"parallelism.tp ({tp}) must divide the MLP's intermediate size "
                         f"{shape.intermediate_size}")


def checkpoint_config(shape: ModelShape, dtype: str, mapping: dict) -> dict:
    """The checkpoint's config.json for one of OWN_WRITER's families."""
    tp = mapping["tp_size"]
    config = {
        "architecture": OWN_WRITER[shape.architecture], "dtype": dtype, "logits_dtype": "float32",
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_size": shape.head_dim,
        "norm_epsilon": shape.rms_norm_eps, "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "swiglu" if shape.num_experts else shape.hidden_act,
        "rotary_base": float(shape.rope_theta), "rotary_scaling": _rotary_scaling(shape),
        "attn_bias": shape.attention_bias, "mlp_bias": shape.mlp_bias,
        "use_parallel_embedding": shape.architecture == "gemma3" and tp > 1,
        "embedding_sharding_dim": 0, "share_embedding_table": False,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "mapping": mapping, "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if shape.num_experts:
        config["moe"] = {"num_experts": shape.num_experts, "shared_expert_intermediate_size": 0,
                         "top_k": shape.num_experts_per_tok,
                         "normalization_mode": RENORMALIZE if shape.norm_topk_prob else NONE}
    if shape.architecture == "qwen3_moe":
        config.update(qwen_type="qwen3_moe", moe_intermediate_size=shape.moe_intermediate_size,
                      moe_shared_expert_intermediate_size=0, use_logn_attn=False)
    if shape.architecture == "gemma3":
        scale = shape.attention_scale or shape.head_dim ** -0.5
        config.update(inter_layernorms=True, query_pre_attn_scalar=round(scale ** -2, 6),
                      final_logit_softcapping=None,
                      _sliding_window_pattern=sliding_window_pattern(shape),
                      rope_local_base_freq=float(shape.rope_local_theta or shape.rope_theta),
                      sliding_window=shape.sliding_window)
    return config


def _rotary_scaling(shape: ModelShape) -> dict | None:
    rope = dict(shape.rope_scaling or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("rope_theta", None)
    return None if kind == "default" else {"type": kind, **rope}


def attention_windows(shape: ModelShape, max_seq_len: int) -> list[int] | None:
    """Per layer, the KV window the runtime must be given (`max_attention_window_size`): the
    engine itself attends over whatever the KV cache keeps. None: every layer global."""
    if shape.layer_types is None or shape.sliding_window is None:
        return None
    return [min(shape.sliding_window, max_seq_len) if t == "sliding_attention" else max_seq_len
            for t in shape.layer_types]

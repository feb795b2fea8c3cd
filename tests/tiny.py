"""Tiny random-weight checkpoints of the Llama family, made with transformers, and engines built
from them. Shared by the test modules (import it as `tiny`)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

CORPUS = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
          "Streams of tokens flow through the paged cache while the scheduler batches requests. "
          "Bonjour, ça va? Grüße aus München! 日本語のテキストも少し。 Emoji 🚀 too. ") * 8

SHAPES = {
    # name: (transformers config class name, kwargs)
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False)),
    "llama_mha_rope_scaled": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=512)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                      sliding_window=None, tie_word_embeddings=False)),
    "qwen2_bias_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False)),
}


def make_tokenizer(out_dir: Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a small built-in corpus, saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(out_dir))
    return fast


FAMILY_PREFIX = "family:"


def family_shapes() -> list[str]:
    """One shape per registered model family ("family:gemma3", ...): the family's own example
    fields over the small sizes below. Registering a family adds it here."""
    from triton_backend.engine import families

    return [f"{FAMILY_PREFIX}{name}" for name in families.architectures()]


def _hf_config(shape: str, tokenizer):
    import transformers

    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                 max_position_embeddings=256, tie_word_embeddings=False,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    if shape.startswith(FAMILY_PREFIX):
        from triton_backend.engine import families

        family = families.get(shape[len(FAMILY_PREFIX):])
        return transformers.AutoConfig.for_model(family.model_types[0],
                                                 **{**sizes, **family.example})
    class_name, kwargs = SHAPES[shape]
    return getattr(transformers, class_name)(**{**sizes, **kwargs})


def make_checkpoint(out_dir: Path, shape: str, seed: int = 0, init_std: float = 0.15) -> Path:
    """Save a random-weight checkpoint of `shape` (a name in SHAPES or a family shape) and a
    tokenizer to `out_dir`.

    A larger init std than transformers' 0.02 makes the logits peaked, so greedy argmaxes are not
    near-ties that float rounding could flip. Biases and norm weights, which start at zero or
    one, are drawn too, so that they matter."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out_dir)
    config = _hf_config(shape, tokenizer)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=init_std)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            torch.nn.init.normal_(p, mean=1.0 if config.model_type != "gemma3_text" else 0.0,
                                  std=0.5)
        elif "layernorm" in name and config.model_type == "gemma3_text":
            torch.nn.init.normal_(p, std=0.3)  # (1 + w): around one
    model.save_pretrained(str(out_dir))
    return out_dir


def build_engine(tmp: Path, shape: str = "llama_gqa", dtype: str = "float32",
                 repository: bool = False, **spec_overrides) -> Path:
    """Checkpoint + engine under `tmp`; returns the engine dir. Overrides go to the spec sections."""
    from rich.console import Console

    from builder.pipeline.engine_builder import build_engine as _build
    from builder.spec.load import spec_from_dict

    slug = shape.replace(":", "-")
    checkpoint = make_checkpoint(tmp / f"hf-{slug}", shape)
    spec = {"name": f"tiny-{slug}".replace("_", "-"), "checkpoint": str(checkpoint),
            "dtype": dtype, "output": str(tmp / f"engine-{slug}"),
            "limits": {"max_batch_size": 16, "max_num_tokens": 256, "max_input_len": 128,
                       "max_seq_len": 256},
            "kv_cache": {"tokens_per_block": 8, "num_blocks": 256}}
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return _build(spec_from_dict(spec), console=Console(quiet=True), emit_repository=repository,
                  repository_dir=tmp / "model_repository")


def one_byte_kv_engine(engine_dir: Path, tmp: Path, kv_dtype: str, scale: float = 0.05) -> Path:
    """A copy of `engine_dir` whose KV cache stores one byte per element ('int8' or 'fp8'), with
    the same made-up key and value scale for every layer (instead of calibrating)."""
    import json
    import shutil

    copy = tmp / f"engine-{kv_dtype}"
    shutil.copytree(engine_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    layers = config["model"]["num_hidden_layers"]
    config["kv_cache"]["dtype"] = kv_dtype
    config["extra"]["quantization"] = {"kv_cache_scales": {"k": [scale] * layers,
                                                           "v": [scale] * layers}}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def final_response(executor, request_id, timeout=60.0):
    """The final response of `request_id` from an executor (either isolation), waiting at most
    `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for response in executor.await_responses(request_id, timeout=1.0):
            if response.is_final:
                return response
    raise AssertionError(f"no final response for {request_id} within {timeout}s")

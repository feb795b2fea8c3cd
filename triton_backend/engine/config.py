"""The engine's `config.json`: the single source of truth for the runtime and the repository emitter.

Written once by the builder, read by the runtime and by `forge repository`. Every section is a
dataclass validated in `__post_init__`; errors are `ValueError`s naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"

DTYPES = ("float32", "bfloat16", "float16")
ARCHITECTURES = ("llama", "mistral", "qwen2")
TARGETS = ("torch", "trtllm", "naive")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _positive(name: str, value: Any) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class ModelShape:
    """Shape of a Llama-family decoder (Llama GQA/MHA, Mistral, Qwen2 with QKV bias)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        _require(self.architecture in ARCHITECTURES,
                 f"model.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            _positive(f"model.{name}", getattr(self, name))
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"model.num_key_value_heads ({self.num_key_value_heads})")
        _require(self.hidden_act == "silu", f"model.hidden_act must be 'silu', got {self.hidden_act!r}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass
class Limits:
    """Per-engine request limits, named as trtllm-build names them."""

    max_batch_size: int = 16
    max_num_tokens: int = 1024
    max_input_len: int = 1024
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len"):
            _positive(f"limits.{name}", getattr(self, name))
        _require(self.max_input_len < self.max_seq_len,
                 f"limits.max_input_len ({self.max_input_len}) must be < limits.max_seq_len "
                 f"({self.max_seq_len})")


@dataclass
class KVCacheConfig:
    """Paged KV cache: fixed-size blocks; the pool is sized by `num_blocks` or by `memory_bytes`."""

    tokens_per_block: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    dtype: str = "auto"  # auto = the engine dtype; fp8 / int8 come with quantization

    def __post_init__(self) -> None:
        _positive("kv_cache.tokens_per_block", self.tokens_per_block)
        _require(self.num_blocks is None or self.memory_bytes is None,
                 "kv_cache: give num_blocks or memory_bytes, not both")
        if self.num_blocks is not None:
            _positive("kv_cache.num_blocks", self.num_blocks)
        if self.memory_bytes is not None:
            _positive("kv_cache.memory_bytes", self.memory_bytes)
        _require(self.dtype in ("auto", "fp8", "int8"),
                 f"kv_cache.dtype must be auto, fp8 or int8, got {self.dtype!r}")


@dataclass
class Features:
    """Switches in force, named like TensorRT-LLM's build flags."""

    remove_input_padding: bool = True
    paged_kv_cache: bool = True
    context_fmha: bool = True
    gemm_fusion: bool = True  # fused QKV and fused gate/up projections
    in_flight_batching: bool = True
    gpt_attention_plugin: str = "auto"
    gemm_plugin: str = "auto"


@dataclass
class QuantConfig:
    weights: str = "none"
    kv_cache: str = "none"
    group_size: int = 128
    exclude_modules: list[str] = field(default_factory=list)


@dataclass
class TokenizerInfo:
    dir: str = TOKENIZER_DIR
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    has_chat_template: bool = False


@dataclass
class EngineConfig:
    name: str
    target: str
    dtype: str
    model: ModelShape
    limits: Limits = field(default_factory=Limits)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    features: Features = field(default_factory=Features)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    tokenizer: TokenizerInfo = field(default_factory=TokenizerInfo)
    hardware: str = "cpu"
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # sections owned by later stages (repository, quality)

    def __post_init__(self) -> None:
        _require(self.target in TARGETS, f"target must be one of {TARGETS}, got {self.target!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.limits.max_seq_len <= self.model.max_position_embeddings or
                 self.model.rope_scaling is not None,
                 f"limits.max_seq_len ({self.limits.max_seq_len}) exceeds the model's "
                 f"max_position_embeddings ({self.model.max_position_embeddings})")

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, engine_dir: str | Path) -> Path:
        path = Path(engine_dir) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"engine format_version {version!r} is not supported by this runtime "
                f"(it reads format_version {FORMAT_VERSION}); rebuild the engine with this llm-forge")
        sections = {"model": ModelShape, "limits": Limits, "kv_cache": KVCacheConfig,
                    "features": Features, "quantization": QuantConfig, "tokenizer": TokenizerInfo}
        kwargs = dict(data)
        for key, klass in sections.items():
            if key in kwargs:
                kwargs[key] = klass(**kwargs[key])
        return cls(**kwargs)

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineConfig":
        path = Path(engine_dir) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no engine config (is {engine_dir} an engine directory?)")
        config = cls.from_dict(json.loads(path.read_text()))
        from triton_backend.engine.toolchain import check_toolchain

        check_toolchain(engine_dir, config.target)
        return config

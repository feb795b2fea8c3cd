"""The engine's `config.json`: the single source of truth for the runtime and the repository emitter.

Written once by the builder, read by the runtime and by `forge repository`. Every section is a
dataclass validated in `__post_init__`; errors are `ValueError`s naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from triton_backend.engine.numbers import is_int, is_number

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"

DTYPES = ("float32", "bfloat16", "float16")
TARGETS = ("torch", "trtllm", "naive")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _positive(name: str, value: Any) -> None:
    _require(is_int(value) and value >= 1,
             f"{name} must be an integer >= 1, got {value!r}")


HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelShape:
    """Shape of a decoder of one of the model families (`architecture`: engine/families/)."""

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
    # Local attention: a layer whose type is "sliding_attention" sees the last `sliding_window`
    # keys (its own included); None: every layer attends globally. `rope_local_theta`: the rotary
    # base of those layers when it differs from `rope_theta` (Gemma 3).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    # The attention's softmax scale; None: head_dim ** -0.5 (Gemma's query_pre_attn_scalar).
    attention_scale: float | None = None
    # Mixture of experts: each MoE layer routes a token to `num_experts_per_tok` of `num_experts`
    # gated MLPs of `moe_intermediate_size`; `norm_topk_prob`: the kept routing weights are
    # renormalised to sum to one. `dense_layers`: layers with a plain MLP instead.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Which names exist is the family registry's (engine/families/), checked when a model is
        # built: reading a config stays free of torch.
        _require(isinstance(self.architecture, str) and self.architecture != "",
                 f"model.architecture must name a model family, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            _positive(f"model.{name}", getattr(self, name))
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"model.num_key_value_heads ({self.num_key_value_heads})")
        _require(self.hidden_act in HIDDEN_ACTS,
                 f"model.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        self._check_attention_layers()
        self._check_experts()

    def _check_attention_layers(self) -> None:
        layers, window = self.num_hidden_layers, self.sliding_window
        if self.layer_types is not None:
            _require(isinstance(self.layer_types, list) and len(self.layer_types) == layers,
                     f"model.layer_types must list one type per layer ({layers}), got "
                     f"{self.layer_types!r}")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
            _require(not bad, f"model.layer_types: {bad} not among {LAYER_TYPES}")
        if window is not None:
            _require(is_int(window) and 1 <= window <= self.max_position_embeddings,
                     f"model.sliding_window must be an integer in [1, max_position_embeddings="
                     f"{self.max_position_embeddings}], got {window!r}")
        _require(window is not None or "sliding_attention" not in (self.layer_types or []),
                 "model.layer_types has sliding_attention layers but model.sliding_window is "
                 "not set")

    def _check_experts(self) -> None:
        if not self.num_experts:
            _require(not self.num_experts_per_tok and not self.dense_layers,
                     "model.num_experts_per_tok / model.dense_layers need model.num_experts")
            return
        _positive("model.num_experts", self.num_experts)
        _positive("model.num_experts_per_tok", self.num_experts_per_tok)
        _positive("model.moe_intermediate_size", self.moe_intermediate_size)
        _require(self.num_experts_per_tok <= self.num_experts,
                 f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                 f"model.num_experts ({self.num_experts})")
        bad = [i for i in self.dense_layers if not is_int(i) or not 0 <= i < self.num_hidden_layers]
        _require(not bad, f"model.dense_layers: {bad} are not layers of a "
                          f"{self.num_hidden_layers}-layer model")

    def window_of(self, layer: int) -> int | None:
        """How many keys layer `layer` attends (its own included); None: all of them."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


# What older engines' config.json may still carry: the scheduler's ratio, which target_itl_ms
# replaced (an older engine runs with the "auto" target).
RETIRED_LIMITS = ("max_decode_slowdown", "long_prefill_tokens")
AUTO_ITL_STEPS = 3.5
# With "auto", a prefill chunk beside decodes is never cut below this many rows (or the prompt's
# rest): per row, smaller chunks cost more. A 2,048-token prompt prefilled alone in chunks of 64,
# 128, 256 and 2,048 rows took 7.10, 6.08, 5.78 and 5.59 s on a 2-vCPU AVX2 EPYC (medians of 4);
# and in the closed loop every step spent on a sliver of prompt kept a request longer out of the
# decoding batch, so 3.5 decode steps' worth of rows (tens) lost a quarter of the throughput and
# doubled TTFT on 512-2,048-token prompts (docs/benchmarks-measured.md). An explicit
# target_itl_ms is a promise and is kept to the row.
AUTO_MIN_PREFILL_ROWS = 256


@dataclass
class Limits:
    """Per-engine request limits, named as trtllm-build names them."""

    max_batch_size: int = 16
    max_num_tokens: int = 1024
    max_input_len: int = 1024
    max_seq_len: int = 2048
    # The inter-token latency running streams are promised while prompts are prefilled beside
    # them: a step that decodes carries only the prefill rows the step-cost model (step_cost.py)
    # predicts fit within this many ms. "auto": AUTO_ITL_STEPS decode-only steps of the batch
    # at hand (so the promise follows the machine, the model and the load), but never a chunk
    # under AUTO_MIN_PREFILL_ROWS (goodput before evenness); 0: no promise, a
    # prefill takes the whole max_num_tokens budget (vLLM's schedule). Not a trtllm-build
    # setting: our scheduler's.
    target_itl_ms: float | str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len"):
            _positive(f"limits.{name}", getattr(self, name))
        target = self.target_itl_ms
        _require(target == "auto" or (is_number(target) and not isinstance(target, str)
                                      and 0 <= target <= 60_000),
                 f"limits.target_itl_ms must be \"auto\", 0 (no target) or a number of ms in "
                 f"(0, 60000], got {target!r}")
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
    # Reuse the KV of full blocks whose tokens an earlier request computed (TensorRT-LLM's
    # enable_block_reuse); the repository's enable_kv_cache_reuse turns it off at serving time.
    enable_prefix_caching: bool = True
    # On a CUDA GPU: the share of the memory left free once the weights are loaded (and room for
    # a step's activations kept) that the pool takes, TensorRT-LLM's
    # kv_cache_free_gpu_mem_fraction. It sizes the pool where num_blocks / memory_bytes do not.
    free_gpu_mem_fraction: float | None = None

    def __post_init__(self) -> None:
        _positive("kv_cache.tokens_per_block", self.tokens_per_block)
        _require(isinstance(self.enable_prefix_caching, bool),
                 f"kv_cache.enable_prefix_caching must be true or false, "
                 f"got {self.enable_prefix_caching!r}")
        _require(self.num_blocks is None or self.memory_bytes is None,
                 "kv_cache: give num_blocks or memory_bytes, not both")
        if self.num_blocks is not None:
            _positive("kv_cache.num_blocks", self.num_blocks)
        if self.memory_bytes is not None:
            _positive("kv_cache.memory_bytes", self.memory_bytes)
        _require(self.dtype in ("auto", "fp8", "int8"),
                 f"kv_cache.dtype must be auto, fp8 or int8, got {self.dtype!r}")
        fraction = self.free_gpu_mem_fraction
        _require(fraction is None or (is_number(fraction) and 0 < fraction < 1),
                 f"kv_cache.free_gpu_mem_fraction must be a number in (0, 1), got {fraction!r}")


SPECULATIVE_MODES = ("none", "ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: propose `num_draft_tokens` tokens per step and verify them in one
    forward pass of this engine. `ngram` looks the last `prompt_lookup_max`..`prompt_lookup_min`
    tokens up in the sequence so far (prompt lookup); `draft_model` runs the engine in
    `draft_engine` (same tokenizer; a relative path is relative to this engine's directory).
    Speculation pauses while more than `disable_by_batch_size` sequences run: a batch that big
    is compute-bound, and verifying drafts would cost more than it saves."""

    mode: str = "none"
    num_draft_tokens: int = 4
    draft_engine: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        _require(self.mode in SPECULATIVE_MODES,
                 f"speculative.mode must be one of {SPECULATIVE_MODES}, got {self.mode!r}")
        for name in ("num_draft_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            _positive(f"speculative.{name}", getattr(self, name))
        _require(self.num_draft_tokens <= 15,
                 f"speculative.num_draft_tokens must be <= 15, got {self.num_draft_tokens}")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                 f"speculative.prompt_lookup_max ({self.prompt_lookup_max})")
        _require((self.mode == "draft_model") == bool(self.draft_engine),
                 f"speculative.draft_engine is required with mode draft_model and only with it "
                 f"(mode {self.mode!r}, draft_engine {self.draft_engine!r})")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


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
    zero_point: bool = False  # INT4 with a zero per group (weights_scaling_factor and zero)
    lm_head: str = "none"  # int8: the LM head quantized at load (CPU kernels), see LM_HEAD_MODES


@dataclass
class TokenizerInfo:
    dir: str = TOKENIZER_DIR
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    has_chat_template: bool = False


LORA_ADAPTERS_DIR = "lora"


@dataclass
class LoraAdapterInfo:
    """One adapter built into the engine: `file` (relative to the engine directory) holds its
    weights in the runtime layout (see `triton_backend/engine/lora/layout.py`)."""

    name: str
    task_id: int
    file: str
    rank: int
    sha256: str
    target_modules: list[str] = field(default_factory=list)
    source: str = ""


@dataclass
class LoraConfig:
    """Multi-LoRA serving. `max_rank`: the largest rank an adapter may have (built in or sent
    with a request); `max_loras`: adapters resident for compute, and the most distinct adapters
    one step may run; `max_cpu_loras`: adapters kept in host memory (built-in ones come back from
    the engine directory, adapters sent with a request must be sent again once evicted)."""

    max_rank: int = 64
    max_loras: int = 8
    max_cpu_loras: int = 32
    adapters: list[LoraAdapterInfo] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("max_rank", "max_loras", "max_cpu_loras"):
            _positive(f"lora.{name}", getattr(self, name))
        _require(self.max_rank <= 1024, f"lora.max_rank must be <= 1024, got {self.max_rank}")
        _require(self.max_cpu_loras >= self.max_loras,
                 f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= lora.max_loras "
                 f"({self.max_loras})")
        self.adapters = [a if isinstance(a, LoraAdapterInfo) else LoraAdapterInfo(**a)
                         for a in self.adapters]
        names = [a.name for a in self.adapters]
        _require(len(set(names)) == len(names), f"lora.adapters: duplicate names in {names}")
        ids = [a.task_id for a in self.adapters]
        _require(len(set(ids)) == len(ids), f"lora.adapters: duplicate task ids in {ids}")

    def adapter(self, name: str) -> LoraAdapterInfo | None:
        return next((a for a in self.adapters if a.name == name), None)


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    hardware: str = "cpu"
    lora: LoraConfig | None = None  # None: the engine serves no adapters
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
                    "features": Features, "quantization": QuantConfig, "tokenizer": TokenizerInfo,
                    "speculative": SpeculativeConfig}
        kwargs = dict(data)
        if kwargs.get("lora") is not None:
            kwargs["lora"] = LoraConfig(**kwargs["lora"])
        if "limits" in kwargs:  # engines built before target_itl_ms replaced the ratio
            kwargs["limits"] = {k: v for k, v in kwargs["limits"].items()
                                if k not in RETIRED_LIMITS}
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

"""What a user may tune in the emitted repository: the build spec's `repository:` section,
read by the spec and by the repository emitter (`emit.py`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from builder.repository.device import check_instance_options
from builder.repository.trtllm import check_trtllm_options
from triton_backend.engine.numbers import is_int
from triton_backend.engine.process.executor import ENGINE_ISOLATIONS
from triton_backend.engine.sampling_params import SamplingParams


def _int_at_least(name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"repository.{name} must be an integer >= {low}, got {value!r}")


@dataclass
class RepositoryOptions:
    """What a user may tune in the emitted repository (the build spec's `repository:` section).

    `triton_max_batch_size` None means the engine's `limits.max_batch_size`. `max_queue_size` 0
    means no queue limit (Triton's meaning). `engine_isolation` "process" runs the engine in a
    process of its own (see `triton_backend.engine.process.main`); `engine_num_threads` 0 gives
    it every core the server may use. KV budget: at most one of `kv_cache_num_blocks` and
    `kv_cache_memory_bytes`; neither means the engine's own `kv_cache` section decides. The
    `default_*` sampling values apply to requests that do not set them (greedy by default).
    """

    triton_max_batch_size: int | None = None
    preprocessing_instance_count: int = 1
    tensorrt_llm_instance_count: int = 1
    postprocessing_instance_count: int = 1
    bls_instance_count: int = 1
    bls_max_concurrent_requests: int = 64
    max_queue_size: int = 0
    max_queue_delay_microseconds: int = 0
    decoupled: bool = True
    kv_cache_num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    exclude_input_in_output: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    default_temperature: float = 0.0
    default_top_k: int = 0
    default_top_p: float = 1.0
    stats_period_ms: int = 100
    engine_isolation: str = "process"
    engine_num_threads: int = 0
    # trtllm engines (see builder/repository/trtllm.py): `auto` = NVIDIA's C++ backend for trtllm
    # engines, our Python model for the others.
    tensorrt_llm_backend: str = "auto"
    kv_cache_free_gpu_mem_fraction: float | None = None  # None: the hardware profile's
    batch_scheduler_policy: str = "guaranteed_no_evict"
    # Off switches (true: as the engine's config.json says). enable_kv_cache_reuse is NVIDIA's name
    # for prefix caching and serves both targets.
    enable_kv_cache_reuse: bool = True
    enable_speculative_decoding: bool = True
    enable_chunked_context: bool = True
    # The GPU backend's decode steps replayed as CUDA graphs (TensorRT-LLM's cuda_graph_mode);
    # false runs every step eagerly. No effect on a CPU engine.
    cuda_graph_mode: bool = True
    trtllm_engine_path: str | None = None  # gpt_model_path as the server sees it (None: absolute)
    # Where a torch engine's tensorrt_llm instance runs (see builder/repository/device.py): auto =
    # KIND_GPU for a GPU engine, KIND_CPU otherwise; model = KIND_MODEL on gpu_device_ids.
    tensorrt_llm_instance_kind: str = "auto"
    gpu_device_ids: str | int | None = None

    def __post_init__(self) -> None:
        if self.triton_max_batch_size is not None:
            _int_at_least("triton_max_batch_size", self.triton_max_batch_size, 1)
        for name in ("preprocessing_instance_count", "tensorrt_llm_instance_count",
                     "postprocessing_instance_count", "bls_instance_count",
                     "bls_max_concurrent_requests", "stats_period_ms"):
            _int_at_least(name, getattr(self, name), 1)
        for name in ("max_queue_size", "max_queue_delay_microseconds"):
            _int_at_least(name, getattr(self, name), 0)
        for name in ("decoupled", "exclude_input_in_output", "add_special_tokens",
                     "skip_special_tokens", "enable_speculative_decoding", "cuda_graph_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"repository.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if self.engine_isolation not in ENGINE_ISOLATIONS:
            raise ValueError(f"repository.engine_isolation must be one of "
                             f"{', '.join(ENGINE_ISOLATIONS)}, got {self.engine_isolation!r}")
        _int_at_least("engine_num_threads", self.engine_num_threads, 0)
        if self.kv_cache_num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("repository: give kv_cache_num_blocks or kv_cache_memory_bytes, "
                             "not both")
        for name in ("kv_cache_num_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 1)
        try:
            SamplingParams(temperature=self.default_temperature, top_k=self.default_top_k,
                           top_p=self.default_top_p)
        except ValueError as exc:
            raise ValueError(f"repository.default_{exc}") from None
        check_trtllm_options(self)
        check_instance_options(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "RepositoryOptions":
        """Build from a spec section; unknown keys are errors naming the key."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"repository: unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

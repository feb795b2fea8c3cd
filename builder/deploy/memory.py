"""The model-server pod's memory, computed from the engine, with headroom.

Where the engine runs on the pod's CPU (target torch, hardware cpu), the pod's memory holds:

- the weights: the model's parameters at the bytes per weight the engine keeps (its dtype, or
  the quantized format for the linear layers);
- the KV cache: the pool the engine allocates at start, every block at once (torch writes the
  zeros, so it is resident from the first second);
- the runtime: tritonserver, the four Python-backend stubs, forge serve with its OpenAI API, the
  engine process's torch, kernels and GEMM plans (`RUNTIME_BYTES`, measured);
- the peak under load: one step's activations (`max_num_tokens` rows, `ACTIVATION_BYTES` per
  row and unit of width, measured) and what requests in flight hold in the servers
  (`LOAD_BYTES`, measured).

The request and the limit are their sum plus `HEADROOM` (25%), rounded up to 64 MiB: one value
for both, so the pod is Guaranteed and the scheduler places it where that much is free. How the
constants were measured (PSS of every process under forge serve, idle and under load):
docs/deploy.md, "Memory", and `forge bench memory` (builder/bench/serve_memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 2**20
GIB = 2**30
HEADROOM = 0.25
ROUND_BYTES = 64 * MIB
# Measured (docs/deploy.md, "Memory"): SmolLM2-135M bf16, 1 GiB KV cache, the highest idle PSS
# of every process under forge serve in three runs, less its weights and KV cache, rounded up.
RUNTIME_BYTES = 1664 * MIB
# Measured: what the PSS rose by under 32 streams through the OpenAI API, less the activations.
LOAD_BYTES = 256 * MIB
# Measured: a 2,000-token prefill raised the engine's peak RSS by 57 MiB at width 576 + 1536
# (hidden + intermediate): 14 bytes per row and unit; 16 here.
ACTIVATION_BYTES = 16
# Bytes per weight the runtime keeps (float16 runs as bfloat16 on a CPU); quantized formats
# for the linear layers (INT4 packs two per byte plus group scales, FP8 one).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED_BYTES = {"int4_awq": 0.53, "int4_rtn": 0.53, "fp8": 1.0}


@dataclass(frozen=True)
class MemoryEstimate:
    """What the pod holds, in bytes; `need` is the sum, `quantity` the request and limit."""

    weights: int
    kv_cache: int
    runtime: int
    peak: int

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + self.runtime + self.peak

    @property
    def with_headroom(self) -> int:
        return math.ceil(self.need * (1 + HEADROOM) / ROUND_BYTES) * ROUND_BYTES

    @property
    def quantity(self) -> str:
        return f"{self.with_headroom // MIB}Mi"

    def parts(self) -> str:
        return (f"weights {self.weights / MIB:.0f} + KV cache {self.kv_cache / MIB:.0f} + "
                f"runtime {self.runtime / MIB:.0f} + peak under load {self.peak / MIB:.0f} = "
                f"{self.need / MIB:.0f} MiB")

    def describe(self) -> str:
        return f"{self.parts()}; with {HEADROOM:.0%} headroom {self.quantity}"


def weight_bytes(config) -> int:
    """The weights of an `EngineConfig` as the runtime holds them."""
    from builder.spec.hardware import parameter_count

    shape, quant = config.model, config.quantization
    total = parameter_count(shape)
    dense = DTYPE_BYTES[config.dtype]
    if quant.weights == "none":
        return int(total * dense)
    embedding = shape.vocab_size * shape.hidden_size  # never quantized
    return int(embedding * dense + (total - embedding) * QUANTIZED_BYTES[quant.weights])


def kv_cache_bytes(config, repository) -> int:
    """The KV pool the engine allocates: the repository's budget if the spec sets one (a
    `RepositoryOptions`), else the engine's own `kv_cache` section (`plan_pool`)."""
    import torch

    from triton_backend.engine.kv_pool import kv_bytes_per_token, plan_pool

    dtype = torch.bfloat16 if config.dtype == "float16" else getattr(torch, config.dtype)
    blocks = plan_pool(config, dtype, None, repository.kv_cache_num_blocks,
                       repository.kv_cache_memory_bytes).num_blocks
    return blocks * config.kv_cache.tokens_per_block * kv_bytes_per_token(config, dtype)


def activation_bytes(config) -> int:
    shape = config.model
    return (config.limits.max_num_tokens * (shape.hidden_size + shape.intermediate_size)
            * ACTIVATION_BYTES)


def estimate(config, repository) -> MemoryEstimate:
    """The pod's memory for an engine config and its `RepositoryOptions`."""
    return MemoryEstimate(weights=weight_bytes(config),
                          kv_cache=kv_cache_bytes(config, repository),
                          runtime=RUNTIME_BYTES,
                          peak=LOAD_BYTES + activation_bytes(config))


def estimate_for_spec(spec) -> MemoryEstimate | None:
    """The estimate of `spec`'s engine, from its checkpoint (converted once and cached, as the
    build does); None where the engine's weights and KV cache are not in the pod's memory (a
    GPU) or another runtime serves (trtllm, naive): the spec's resources stand there."""
    from builder.pipeline import convert
    from builder.pipeline.checkpoint import resolve_checkpoint
    from builder.pipeline.engine_files import engine_config_for
    from builder.spec.hardware import PROFILES
    from builder.repository.options import RepositoryOptions

    if spec.target != "torch" or PROFILES[spec.hardware].is_gpu:
        return None
    hf_dir = resolve_checkpoint(spec.checkpoint, log=lambda line: None)
    config = engine_config_for(spec, hf_dir, convert.read_hf_config(hf_dir))
    return estimate(config, RepositoryOptions.from_dict(spec.repository))


def check_given(resources, estimate: MemoryEstimate) -> None:
    """The spec's own memory, if it gives one, must cover the engine: the limit its need with
    headroom, the request its need. ValueError naming the field otherwise."""
    from builder.spec.deployment import parse_quantity

    for key, floor, what in (
            ("memory_limit", estimate.with_headroom,
             f"the engine's need with {HEADROOM:.0%} headroom"),
            ("memory_request", estimate.need, "the engine's need")):
        value = getattr(resources, key)
        if value is not None and parse_quantity(f"deployment.resources.{key}", value) < floor:
            raise ValueError(
                f"deployment.resources.{key}: {value} is under {floor / MIB:.0f} MiB, {what} "
                f"({estimate.parts()}); leave memory_request and memory_limit out to have them "
                f"computed")

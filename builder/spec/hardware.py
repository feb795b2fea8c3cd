"""Hardware profiles: what each GPU can do, and engine limits sized from the model and its memory.

A profile is what `trtllm-build`, NVIDIA's backend and our torch runtime need to know about the
target GPU: its SM version (FP8 tensor cores and FP8 context FMHA need SM >= 89: Ada and Hopper),
its memory, and the share of free memory the runtime gives the KV cache
(`kv_cache_free_gpu_mem_fraction`). `cuda` is any CUDA GPU, for the torch target only: its SM and
memory are known only where the engine runs, so nothing is sized from them at build time.

Sizing is arithmetic, not measurement: per GPU, the weights (divided by tp * pp) and an
activation/workspace reserve come off the memory; the KV cache gets `kv_cache_free_gpu_mem_fraction`
of the rest. At least one sequence of `max_seq_len` tokens must fit in that budget (otherwise the
runtime fails at load, the error NVIDIA's users hit with too long sequences for their GPU);
`max_batch_size` is the number of half-length sequences that fit, as a power of two.
"""
from __future__ import annotations

from dataclasses import dataclass

from triton_backend.engine.config import Limits, ModelShape

GIB = 2**30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    sm: int | None                 # compute capability x 10; None: the CPU, or unknown (cuda)
    memory_bytes: int | None       # per GPU; None: the CPU, or unknown (cuda)
    kv_cache_free_gpu_mem_fraction: float = 0.9
    # Activations, CUDA graphs, cuBLAS / NCCL workspaces and the runtime's buffers.
    reserve_bytes: int = 2 * GIB
    is_gpu: bool = True

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores (weights, KV cache, context FMHA): Ada (89) and Hopper (90)."""
        return self.sm is not None and self.sm >= 89

    @property
    def may_run_fp8(self) -> bool:
        """FP8 weights are not refused at build time: a known FP8 GPU, or any GPU (`cuda`), where
        the engine finds out when it loads."""
        return self.fp8 or (self.is_gpu and self.sm is None)

    @property
    def sized(self) -> bool:
        """Limits and the KV budget can be sized from the memory before the engine runs."""
        return self.memory_bytes is not None


ANY_GPU = "cuda"
PROFILES = {p.name: p for p in (
    HardwareProfile("cpu", sm=None, memory_bytes=None, is_gpu=False),
    HardwareProfile("l4", sm=89, memory_bytes=24 * GIB),
    HardwareProfile("a100-40gb", sm=80, memory_bytes=40 * GIB),
    HardwareProfile("a100-80gb", sm=80, memory_bytes=80 * GIB),
    HardwareProfile("h100-80gb", sm=90, memory_bytes=80 * GIB),
    HardwareProfile(ANY_GPU, sm=None, memory_bytes=None),
)}
# The GPUs whose SM and memory are known: what trtllm-build can build for.
GPU_PROFILES = tuple(name for name, p in PROFILES.items() if p.is_gpu and p.sm is not None)
FP8_PROFILES = tuple(name for name, p in PROFILES.items() if p.fp8)
# Where the torch target runs: the CPU, a known GPU, or any CUDA GPU.
TORCH_GPU_PROFILES = GPU_PROFILES + (ANY_GPU,)

# Bytes per weight as stored: INT4 packs two per byte (group scales are ~1/32 of that for
# group 128 in 16-bit and are counted in the 0.53); FP8 one byte.
WEIGHT_BYTES = {"none": 2.0, "int4_awq": 0.53, "int4_rtn": 0.53, "fp8": 1.0}
KV_BYTES = {"none": 2, "fp8": 1, "int8": 1}
MAX_BATCH_SIZE = 256      # beyond this the scheduler, not memory, is the limit
MAX_NUM_TOKENS = 8192     # TensorRT-LLM's default token budget per step


def parameter_count(shape: ModelShape) -> int:
    """Weights of the model (its family's module tree: embedding, layers, untied lm_head)."""
    from triton_backend.engine import families

    return families.get(shape.architecture).parameter_count(shape)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory arithmetic for one engine; all sizes in bytes."""

    weights_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token if self.kv_budget_bytes > 0 else 0


def memory_plan(shape: ModelShape, profile: HardwareProfile, weights: str = "none",
                kv_cache: str = "none", tp: int = 1, pp: int = 1,
                kv_cache_free_gpu_mem_fraction: float | None = None,
                element_bytes: int = 2) -> MemoryPlan:
    """Weights and KV budget per GPU for `shape` split tp x pp on `profile`. `element_bytes`:
    the size of an unquantized weight and KV element (TensorRT-LLM builds 16-bit engines; the
    torch target also float32 ones)."""
    if not profile.is_gpu or profile.memory_bytes is None:
        raise ValueError(f"hardware: {profile.name!r} is not a GPU profile of known memory")
    per_weight = element_bytes if weights == "none" else WEIGHT_BYTES[weights]
    weights_bytes = int(parameter_count(shape) * per_weight / (tp * pp))
    fraction = (profile.kv_cache_free_gpu_mem_fraction if kv_cache_free_gpu_mem_fraction is None
                else kv_cache_free_gpu_mem_fraction)
    free = profile.memory_bytes - profile.reserve_bytes - weights_bytes
    # KV heads are split over tp (replicated when tp > kv heads); layers over pp.
    kv_heads = max(1, shape.num_key_value_heads // tp)
    layers = -(-shape.num_hidden_layers // pp)
    kv_element = element_bytes if kv_cache == "none" else KV_BYTES[kv_cache]
    per_token = 2 * layers * kv_heads * shape.head_dim * kv_element
    return MemoryPlan(weights_bytes=weights_bytes, kv_budget_bytes=int(max(free, 0) * fraction),
                      kv_bytes_per_token=per_token)


def _power_of_two_floor(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


def check_fits(plan: MemoryPlan, profile: HardwareProfile, max_seq_len: int,
               split: bool = True) -> None:
    """One full-length sequence must fit the KV budget; the error names the fields and numbers.
    `split`: the engine may be split over GPUs (tp / pp, TensorRT-LLM's), so the remedy says so."""
    more_gpus = " or raise parallelism.tp / parallelism.pp" if split else ""
    if plan.kv_budget_bytes <= 0:
        memory = (profile.memory_bytes or 0) / GIB
        raise ValueError(
            f"hardware: the weights ({plan.weights_bytes / GIB:.1f} GiB per GPU) leave no memory "
            f"for the KV cache on {profile.name} ({memory:.0f} GiB); quantize the weights"
            f"{more_gpus}")
    if plan.kv_tokens < max_seq_len:
        raise ValueError(
            f"limits.max_seq_len ({max_seq_len}) does not fit the KV cache on {profile.name}: "
            f"{plan.kv_budget_bytes / GIB:.1f} GiB hold {plan.kv_tokens} tokens "
            f"({plan.kv_bytes_per_token} bytes each); "
            + ("lower limits.max_seq_len, quantize the KV cache or raise parallelism.tp" if split
               else "lower limits.max_seq_len or quantize the KV cache"))


def sized_limits(shape: ModelShape, profile: HardwareProfile, plan: MemoryPlan,
                 tokens_per_block: int, given: Limits | None = None, split: bool = True) -> Limits:
    """`given` limits checked against the memory, or limits sized from it when none are given.

    Sized: max_seq_len = the model's context (up to 8192), max_input_len half of it, max_batch_size
    the half-length sequences that fit (a power of two, <= 256), max_num_tokens the KV tokens up to
    8192, in whole KV blocks.
    """
    if given is not None:
        check_fits(plan, profile, given.max_seq_len, split)
        return given
    max_seq_len = min(8192, shape.max_position_embeddings)
    check_fits(plan, profile, max_seq_len, split)
    batch = _power_of_two_floor(plan.kv_tokens // max(1, max_seq_len // 2))
    num_tokens = min(MAX_NUM_TOKENS, plan.kv_tokens) // tokens_per_block * tokens_per_block
    return Limits(max_batch_size=min(MAX_BATCH_SIZE, batch),
                  max_num_tokens=max(num_tokens, tokens_per_block),
                  max_input_len=max_seq_len // 2, max_seq_len=max_seq_len)

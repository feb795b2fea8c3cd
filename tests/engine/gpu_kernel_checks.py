"""The GPU backend's Triton kernels against their torch references, run by Triton's interpreter
on the CPU (TRITON_INTERPRET=1, set by the test that starts this script in a process of its own,
so no other test imports Triton). Prints one line per case; exits 1 on the first mismatch."""
from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter"

from triton_backend.engine.gpu import fused  # noqa: E402
from triton_backend.engine.gpu.paged_attention import (  # noqa: E402
    paged_attention, paged_attention_reference)
from triton_backend.engine.ops import TorchOps  # noqa: E402
from triton_backend.engine.quant.kv_cache import quantize_kv  # noqa: E402


def _case(seed: int, num_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int,
          chunks: list[tuple[int, int]], dtype: torch.dtype, kv: str = "auto",
          num_splits: int = 1, window: int = 0) -> float:
    """chunks: (cached keys, new rows) per sequence. Returns the max |kernel - reference|."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // tokens_per_block) for c, n in chunks) + 1
    num_blocks = len(chunks) * max_blocks + 3
    slots = num_blocks * tokens_per_block
    if kv == "auto":
        k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=generator).to(dtype)
        v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=generator).to(dtype)
        k_scale = v_scale = 1.0
    else:
        k_cache = torch.randint(-100, 100, (slots, num_kv_heads, head_dim), generator=generator,
                                dtype=torch.int8)
        v_cache = torch.randint(-100, 100, (slots, num_kv_heads, head_dim), generator=generator,
                                dtype=torch.int8)
        if kv == "fp8":
            k_cache = (k_cache.float() / 30).to(torch.float8_e4m3fn)
            v_cache = (v_cache.float() / 30).to(torch.float8_e4m3fn)
        k_scale, v_scale = 0.03, 0.05
    # Blocks handed out shuffled, as a pool that has been used for a while hands them out.
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for b in range(len(chunks)):
        tables[b] = torch.tensor(order[b * max_blocks:(b + 1) * max_blocks], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    query_start = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1])
                                      for i in range(len(chunks))], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), num_heads, head_dim, generator=generator).to(dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, query_start, tokens_per_block, head_dim ** -0.5)
    expected = paged_attention_reference(*args, k_scale=k_scale, v_scale=v_scale, window=window)
    got = paged_attention(*args, max_query_len=max(n for _, n in chunks), k_scale=k_scale,
                          v_scale=v_scale, num_splits=num_splits, window=window)
    return float((got.float() - expected.float()).abs().max())


CASES = [
    # name, kwargs, tolerance
    ("decode gqa4 fp32", dict(num_heads=8, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                              chunks=[(5, 1), (17, 1), (0, 1), (40, 1)], dtype=torch.float32), 1e-5),
    ("decode gqa3 d64 fp32", dict(num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=16,
                                  chunks=[(33, 1), (1, 1)], dtype=torch.float32), 1e-5),
    ("prefill + prefix fp32", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                                   chunks=[(0, 13), (16, 7), (3, 40), (0, 1)],
                                   dtype=torch.float32), 1e-5),
    ("mha d80 fp32", dict(num_heads=2, num_kv_heads=2, head_dim=80, tokens_per_block=4,
                          chunks=[(9, 3), (0, 5)], dtype=torch.float32), 1e-5),
    ("splits fp32", dict(num_heads=8, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                         chunks=[(100, 1), (3, 1), (0, 1), (60, 4)], dtype=torch.float32,
                         num_splits=4), 1e-5),
    ("bf16", dict(num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
                  chunks=[(20, 1), (0, 9), (31, 2)], dtype=torch.bfloat16), 2e-2),
    ("int8 kv", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                     chunks=[(11, 1), (4, 6)], dtype=torch.float32, kv="int8"), 1e-5),
    ("fp8 kv", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                    chunks=[(11, 1), (4, 6)], dtype=torch.bfloat16, kv="fp8"), 2e-2),
    # Prompts' first chunks, packed (the GPU backend's prefill): long and short, GQA and MHA.
    ("first chunks gqa4 bf16", dict(num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
                                    chunks=[(0, 100), (0, 7), (0, 1), (0, 33)],
                                    dtype=torch.bfloat16), 2e-2),
    ("first chunks mha fp32", dict(num_heads=4, num_kv_heads=4, head_dim=16, tokens_per_block=8,
                                   chunks=[(0, 70), (0, 2), (0, 65)], dtype=torch.float32), 1e-5),
    # A local layer's window: decodes past it, chunks across it, one inside it, split keys.
    ("window fp32", dict(num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=8,
                         chunks=[(40, 1), (30, 20), (0, 50), (3, 2)], dtype=torch.float32,
                         window=12), 1e-5),
    ("window splits bf16", dict(num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
                                chunks=[(200, 1), (5, 1), (90, 3)], dtype=torch.bfloat16,
                                num_splits=4, window=64), 2e-2),
    # Keys as computed: the step's own rows as a cache of one-token blocks.
    ("one-token blocks fp32", dict(num_heads=6, num_kv_heads=2, head_dim=16, tokens_per_block=1,
                                   chunks=[(0, 30), (0, 5), (0, 1)], dtype=torch.float32), 1e-5),
]


def _ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None
          ) -> float:
    """The largest difference in units of the last place of the values' magnitude (the
    expected value's, or `magnitude`'s where a sum cancels): 0 when equal."""
    if got.dtype == torch.float32:
        return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30)
                     / torch.finfo(torch.float32).eps)
    size = expected.float().abs() if magnitude is None else magnitude.float().abs()
    spacing = torch.finfo(got.dtype).eps * size.clamp(min=1e-3)
    return float(((got.float() - expected.float()).abs() / spacing).max())


def _same_bytes(got: torch.Tensor, expected: torch.Tensor, values: torch.Tensor) -> bool:
    """The stored bytes equal the expected ones. FP8 under the interpreter: its float32 -> e4m3
    conversion rounds ties up where torch (and the GPU) round them to even, and drops the carry
    of a rounding that reaches the next power of two (1.98 becomes 1, not 2); a difference must
    be one of those two, for the quantized `values` (float32, before the cast)."""
    if got.dtype != torch.float8_e4m3fn:
        return torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    differ = got.float() != expected.float()
    g, e, x = got.float()[differ], expected.float()[differ], values.float()[differ]
    tie = (x - g).abs() == (x - e).abs()
    carry = (torch.exp2(torch.log2(e.abs()).round()) == e.abs()) & (g * 2 == e)
    return bool((tie | carry).all())


def _fused_cases(dtype: torch.dtype) -> dict[str, float]:
    """max ulps of each fused kernel against the torch reference's op."""
    generator = torch.Generator().manual_seed(7)
    ops = TorchOps()
    rows, hidden, heads, kv_heads, head_dim = 5, 80, 4, 2, 16
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    out = {}
    got, new_residual = fused.add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    out["add_rms_norm"] = max(_ulps(got, expected), _ulps(new_residual, expected_residual))
    out["rms_norm"] = _ulps(fused.add_rms_norm(x, None, weight, 1e-5)[0],
                            ops.rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(rows, 2 * 48, generator=generator).to(dtype)
    out["silu_mul"] = _ulps(fused.silu_mul(gate_up), ops.silu_mul(gate_up))
    wide = gate_up * 4  # GELU-tanh's saturated tails too
    out["gelu_tanh_mul"] = _ulps(fused.silu_mul(wide, gelu=True), ops.gelu_tanh_mul(wide))
    from triton_backend.engine.config import ModelShape
    from triton_backend.engine.layers import RotaryEmbedding

    shape = ModelShape("LlamaForCausalLM", 100, heads * head_dim, 64, 1, heads, kv_heads, head_dim)
    rotary = RotaryEmbedding(shape, 64)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([3, 0, 17, 63, 9])
    slots = torch.tensor([5, 1, 30, 7, 12])
    q_ref, k_ref = rotary(positions, qkv[:, :heads * head_dim].view(rows, heads, head_dim),
                          qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
                          .view(rows, kv_heads, head_dim))
    v_ref = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    for kind, kv in enumerate(("auto", "int8", "fp8")):
        storage = {"auto": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
        k_cache = torch.zeros(32, kv_heads, head_dim, dtype=storage)
        v_cache = torch.zeros(32, kv_heads, head_dim, dtype=storage)
        scale = 0.02 if kv != "auto" else 1.0
        q, k = fused.rope_write_cache(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads,
                                      head_dim, k_cache, v_cache, slots, scale, scale, kind)
        q_in = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
        k_in = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads,
                                                                          head_dim)
        q_size = torch.maximum(q_in.abs(), q_in.abs().roll(head_dim // 2, dims=-1))
        k_size = torch.maximum(k_in.abs(), k_in.abs().roll(head_dim // 2, dims=-1))
        ulps = max(_ulps(q, q_ref, q_size), _ulps(k, k_ref, k_size))
        if kv == "auto":
            ulps = max(ulps, _ulps(k_cache[slots], k_ref, k_size),
                       _ulps(v_cache[slots], v_ref))
        else:  # the stored bytes: the torch cache's quantization of the keys it rotated
            same = all(_same_bytes(cache[slots], quantize_kv(ref, scale, kv),
                                   (ref.float() / scale).clamp(-448, 448))
                       for cache, ref in ((k_cache, k), (v_cache, v_ref)))
            ulps = max(ulps, 0.0 if same else float("inf"))
        out[f"rope_write_cache {kv}"] = ulps
    out["quantize_fp8"] = _fp8_quantize_case(dtype, generator)
    return out


def _fp8_quantize_case(dtype: torch.dtype, generator: torch.Generator) -> float:
    """The fused FP8 input quantization against the torch ops it replaces: rows wider than one
    program's block (1,300 > 1,024), values beyond e4m3's range (clamped) and exact ties; 0 when
    every byte is the torch ops' (up to the interpreter's own e4m3 rounding, `_same_bytes`)."""
    from triton_backend.engine.gpu.fp8 import quantize_fp8, quantize_fp8_reference

    scale = torch.tensor(0.015625)  # a power of two: x / scale is exact, ties stay ties
    x = (torch.randn(3, 1300, generator=generator) * 3).to(dtype)
    x[0, :4] = torch.tensor([9.0, -9.0, 0.1, 7.0])  # 576 and -576 clamp to +-448
    x[1, :2] = torch.tensor([0.2265625, 0.2109375])  # 14.5 and 13.5: ties to even
    got, expected = quantize_fp8(x, scale), quantize_fp8_reference(x, scale)
    values = (x.float() / scale).clamp(-448, 448)
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
    assert float(got.float()[0, 0]) == 448.0 and float(got.float()[0, 1]) == -448.0
    return 0.0 if _same_bytes(got, expected, values) else float("inf")


def _engine_case(engine_dir: str) -> int:
    """The GPU backend with every kernel (interpreted) inside the engine: greedy ids against
    transformers on the same checkpoint, batched, with a prefix hit, graphs' buffers replayed."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    engine = LLMEngine(engine_dir)
    assert engine.runner.ops.name == "gpu" and engine.runner.ops.use_kernel
    shared = list(range(3, 27))
    prompts = [shared + [40], [5, 9, 13], shared + [50, 51]]
    new = 8
    results = generate(engine, [Request(p, new, ignore_eos=True) for p in prompts[:2]])
    results += generate(engine, [Request(prompts[2], new, ignore_eos=True)])
    hf = AutoModelForCausalLM.from_pretrained(
        str(Path(engine_dir).parent / f"hf-{Path(engine_dir).name[7:]}"), dtype=torch.float32)
    for prompt, result in zip(prompts, results):
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                               do_sample=False, max_new_tokens=new,
                               min_new_tokens=new)[0, len(prompt):].tolist()
        print(f"engine: {result.output_ids} transformers: {expected}")
        if result.output_ids != expected:
            return 1
    hits = engine.get_stats()["prefix_cache_hit_tokens"]
    print(f"engine: prefix-cache hit tokens {hits}, graph replays {engine.runner.ops.graphs.num_replays}")
    return 0 if hits >= 24 and engine.runner.ops.graphs.num_replays > 0 else 1


def _kernels_against_references(engine_dir: str) -> int:
    """An engine whose every path differs from the plain one (a one-byte cache, n-gram drafts
    verified in multi-row chunks, sampling on the device): the interpreted kernels give the
    tokens their torch references give."""
    from triton_backend.engine import Request, SamplingParams
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    requests = [Request([5, 6, 7, 5, 6, 7, 5, 6], 10, ignore_eos=True),
                Request(list(range(3, 30)), 8, SamplingParams(temperature=0.8, seed=3),
                        ignore_eos=True),
                Request([9, 8, 7, 9, 8, 7, 9], 8, SamplingParams(min_tokens=3), ignore_eos=True)]
    outputs = []
    for use_kernel in (True, False):
        engine = LLMEngine(engine_dir)
        engine.runner.ops.use_kernel = use_kernel
        outputs.append([r.output_ids for r in generate(engine, requests)])
        print(f"kernels {use_kernel}: {outputs[-1]}, drafts "
              f"{engine.get_stats()['spec_num_draft_tokens']}")
    return 0 if outputs[0] == outputs[1] else 1


def main() -> int:
    if len(sys.argv) > 2:  # then an engine with local layers (a sliding window), if given
        return (_engine_case(sys.argv[1]) or _kernels_against_references(sys.argv[2])
                or any(_engine_case(engine) for engine in sys.argv[3:]))
    for seed, (name, kwargs, tolerance) in enumerate(CASES):
        diff = _case(seed, **kwargs)
        print(f"{name}: max |kernel - reference| {diff:.2e} (tolerance {tolerance:.0e})")
        if not diff <= tolerance:
            return 1
    # fp32: equal up to fp32 summation order; bf16: the interpreter truncates where the GPU
    # rounds to nearest, so each of the up to three roundings in a row (rotary's two products
    # and their sum) may land a step apart here (on a GPU, `forge gpu-check` holds the fused
    # ops to at most two bf16 steps of the torch ops: its `fused ops` check, run here too).
    for dtype, limit in ((torch.float32, 64.0), (torch.bfloat16, 3.0)):
        for name, ulps in _fused_cases(dtype).items():
            print(f"fused {name} {dtype}: max {ulps:.2f} ulp from the torch op (limit {limit})")
            if not ulps <= limit:
                return 1
    from builder.gpu_check.fused_ops import fused_cases
    from builder.gpu_check.models import CPU_SHAPES

    # gpu-check's own comparison, interpreted: the interpreter's truncation as above; its FP8
    # bytes differ here only by the interpreter's e4m3 rounding (`_fp8_quantize_case` above
    # holds the kernel to the torch ops' bytes), so that case is printed, not limited.
    for name, (steps, same) in fused_cases(CPU_SHAPES[-1], "cpu").items():
        print(f"gpu-check fused {name}: max {steps:.2f} bf16 steps from the torch op, "
              f"{same:.1%} identical (limit 3.0)")
        if name != "quantize_fp8" and not steps <= 3.0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

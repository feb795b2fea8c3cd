"""Speed in-process: the engine's output tokens per second at a few concurrencies (random
prompts, the end id ignored, prefix caching off), transformers' `generate` on the same batch, and
the memory roofline of a decode step (every weight read once at the measured read rate)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from builder.bench.inprocess import random_prompts
from builder.gpu_check.ledger import count


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_run(engine, prompts: list[list[int]], new_tokens: int, device: str
               ) -> tuple[float, list[float]]:
    """(seconds to finish every request, the duration of each step)."""
    from triton_backend.engine import Request

    for prompt in prompts:
        engine.add_request(Request(prompt, new_tokens, ignore_eos=True))
    steps = []
    _sync(device)
    start = time.perf_counter()
    while engine.has_work():
        began = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - began)
    _sync(device)
    return time.perf_counter() - start, steps


def engine_throughput(engine, concurrencies: list[int], prompt_len: int, new_tokens: int,
                      vocab_size: int, device: str) -> list[dict]:
    """Output tok/s of `engine` (loaded once by the caller) at each concurrency, after a short
    run of the same batch size; random prompts, so the prefix cache finds nothing."""
    rows = []
    for c in concurrencies:
        _timed_run(engine, random_prompts(vocab_size, c, prompt_len, seed=100 + c), 4, device)
        seconds, steps = _timed_run(engine, random_prompts(vocab_size, c, prompt_len, seed=c),
                                    new_tokens, device)
        decode = steps[len(steps) // 2:]  # the second half: decode-only steps
        rows.append({"concurrency": c, "tok_s": c * new_tokens / seconds, "seconds": seconds,
                     "decode_step_ms": 1e3 * statistics.median(decode)})
    return rows


@torch.inference_mode()
def transformers_throughput(model, concurrencies: list[int], prompt_len: int, new_tokens: int,
                            vocab_size: int, device: str) -> list[dict]:
    rows = []
    for c in concurrencies:
        count("reference_runs", 2)
        ids = torch.tensor(random_prompts(vocab_size, c, prompt_len, seed=c), device=device)
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2,
                       min_new_tokens=2)
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens)
        _sync(device)
        seconds = time.perf_counter() - start
        rows.append({"concurrency": c, "tok_s": c * new_tokens / seconds, "seconds": seconds})
    return rows


def memory_read_rate(device: str, size_bytes: int = 2**30, repeats: int = 10) -> float:
    """Bytes per second a reduction over a `size_bytes` tensor reads (median of `repeats`)."""
    x = torch.ones(size_bytes // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - start)
    del x
    return size_bytes / statistics.median(times)


def weight_bytes(engine_dir: Path) -> int:
    from safetensors import safe_open

    from triton_backend.engine.config import WEIGHTS_FILE

    total = 0
    with safe_open(str(engine_dir / WEIGHTS_FILE), framework="pt") as weights:
        for key in weights.keys():
            tensor = weights.get_slice(key)
            total += _numel(tensor.get_shape()) * _itemsize(tensor.get_dtype())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}.get(dtype, 4)

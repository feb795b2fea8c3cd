"""Parity of the engine with transformers on the same device and checkpoint: prefill logits, and
greedy continuations of a batch whose last prompt hits the prefix cache, with the captured
decode steps and without (one engine for both: the graphs are captured between the two)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from builder.gpu_check.ledger import count

PARITY_PROMPTS = 4
PARITY_TOKENS = 24
SHARED_PREFIX = 48  # three full blocks of 16: the late prompt's prefix-cache hit


def parity_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    prompts = [shared + [rng.randrange(3, vocab_size) for _ in range(5)]]
    prompts += [[rng.randrange(3, vocab_size) for _ in range(rng.randint(20, 90))]
                for _ in range(PARITY_PROMPTS - 2)]
    return prompts + [shared + [rng.randrange(3, vocab_size) for _ in range(9)]]


def reference_model(checkpoint: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype,
                                                attn_implementation="sdpa").to(device).eval()


@torch.inference_mode()
def reference_continuations(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        count("reference_runs")
        ids = torch.tensor([prompt], device=model.device)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        out.append(generated[0, len(prompt):].tolist())
    return out


@torch.inference_mode()
def reference_prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits [len(prompt), V] of one prefill, float32 on the host."""
    count("reference_runs")
    return model(torch.tensor([prompt], device=model.device)).logits[0].float().cpu()


def engine_prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Our logits [len(prompt), V] of one prefill, float32 on the host (as offline.prefill_logits
    reads them, on an engine already loaded)."""
    from triton_backend.engine import Request

    engine.add_request(Request(input_token_ids=list(prompt), max_tokens=1))
    chunks = []  # a prompt longer than max_num_tokens is prefilled in several steps
    while engine.has_work():
        engine.step(return_logits=True)
        chunks.append(engine.last_logits.float().cpu())
    return torch.cat(chunks)


def prefill_logits_diff(engine, prompt: list[int], theirs: torch.Tensor) -> dict:
    ours = engine_prefill_logits(engine, prompt)
    return {"max_abs_diff": float((ours - theirs).abs().max()),
            "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


def engine_continuations(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """The batch's greedy ids (all but the last prompt together, then the last, which finds the
    first prompt's blocks cached), the prefix-cache hits and how many steps replayed a graph,
    both counted over this batch alone."""
    from triton_backend.engine import Request
    from triton_backend.engine.offline import generate

    before = engine.get_stats()
    requests = [Request(p, new_tokens, ignore_eos=True) for p in prompts]
    results = generate(engine, requests[:-1]) + generate(engine, requests[-1:])
    after = engine.get_stats()
    return {"ids": [r.output_ids for r in results],
            "prefix_hit_tokens": (after["prefix_cache_hit_tokens"]
                                  - before["prefix_cache_hit_tokens"]),
            "graph_replays": after["cuda_graph_replays"] - before["cuda_graph_replays"],
            "ops": engine.runner.ops.name}


def greedy_parity(expected: list[list[int]], got: list[list[int]]) -> dict:
    matched = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    total = sum(len(e) for e in expected)
    return {"matched_tokens": matched, "total_tokens": total, "exact": expected == got}

"""Parity of the engine with transformers on the same device and checkpoint: prefill logits, and
greedy continuations of a batch whose last prompt hits the prefix cache, with the captured
decode steps and without."""
from __future__ import annotations

import random
from pathlib import Path

import torch

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
        ids = torch.tensor([prompt], device=model.device)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        out.append(generated[0, len(prompt):].tolist())
    return out


def prefill_logits_diff(model, engine_dir: Path, prompt: list[int], device: str) -> dict:
    from triton_backend.engine.offline import prefill_logits

    ours = prefill_logits(engine_dir, prompt, device=device).float()
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt], device=model.device)).logits[0].float()
    return {"max_abs_diff": float((ours.to(theirs.device) - theirs).abs().max()),
            "top1_agreement": float((ours.argmax(-1).to(theirs.device)
                                     == theirs.argmax(-1)).float().mean())}


def engine_continuations(engine_dir: Path, prompts: list[list[int]], new_tokens: int,
                         device: str, cuda_graphs: bool) -> dict:
    """The batch's greedy ids (all but the last prompt together, then the last, which finds the
    first prompt's blocks cached), the prefix-cache hit and how many steps replayed a graph."""
    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    engine = LLMEngine(engine_dir, device=device, enable_cuda_graphs=cuda_graphs)
    requests = [Request(p, new_tokens, ignore_eos=True) for p in prompts]
    results = generate(engine, requests[:-1]) + generate(engine, requests[-1:])
    graphs = engine.runner.graphs
    summary = {"ids": [r.output_ids for r in results],
               "prefix_hit_tokens": engine.get_stats()["prefix_cache_hit_tokens"],
               "graph_replays": graphs.num_replays if graphs is not None else 0,
               "ops": engine.runner.ops.name}
    del engine
    return summary


def greedy_parity(expected: list[list[int]], got: list[list[int]]) -> dict:
    matched = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    total = sum(len(e) for e in expected)
    return {"matched_tokens": matched, "total_tokens": total, "exact": expected == got}

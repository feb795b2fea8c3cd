"""Engine-level speed, every side on the same prompts in one run: our engine in-process, the same
engine in its own process (`engine_process`: the executor the `tensorrt_llm` model serves from,
without Triton), through `tritonserver` (the `tensorrt_llm` model with token ids, the `ensemble`
with text), and `transformers` `generate` with the prompts as one static batch.

    .venv/bin/python scripts/bench_decode.py [--engine engines/smollm2-135m] [--repeats 3]
        [--extra-engine int4=engines/smollm2-135m-int4] [--sides engine,tensorrt_llm,...]

Protocol: --num-prompts prompts of --prompt-len random token ids (seeded; their text re-tokenizes
to the same ids), --max-tokens new tokens each with end ids ignored. c=1: one request alone (TTFT
as the median of --ttft-samples single requests, then the decode rate of a full-length one);
c=N: all at once (tokens/s including prefill, and the time until all have their first token).
Sides run interleaved, --repeats times; the table shows medians and the JSON every run; ratios to
the in-process engine come from the medians and repeat by repeat (each repeat's sides run back to
back, so drift between repeats moves both halves of a pair alike). Extra
engines (e.g. a quantized build) run in-process only. The c=1 decode rate is also shown against
this machine's memory-bandwidth roofline (weight bytes per token / a read bandwidth measured
here). Run it on a quiet machine: on 2 cores any other job distorts every number, and a VM whose
host takes a core away for a while turns a 2-thread step several times slower.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

# Every side runs with the OpenMP spin the engine process uses (set before torch loads).
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.bench.engine_level import (EngineProtocol, InProcessSide,  # noqa: E402
                                        ProcessSide, TransformersSide, as_dict, make_prompts,
                                        measure_one, paired_ratios)
from builder.bench.roofline import decode_weight_bytes, measure_read_bandwidth  # noqa: E402
from triton_backend.engine.config import EngineConfig  # noqa: E402
from triton_backend.engine.tokenizer import load_tokenizer  # noqa: E402

SIDES = ("engine", "engine_process", "tensorrt_llm", "ensemble", "transformers")
METRICS = (("c1", "ttft_s"), ("c1", "decode_tok_s"), ("cN", "tok_s"), ("cN", "prefill_s"))


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/smollm2-135m")
    parser.add_argument("--extra-engine", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-samples", type=int, default=5,
                        help="single requests per repeat whose median is the c=1 TTFT")
    parser.add_argument("--hf-checkpoint", help="checkpoint for the transformers side (default: "
                        "the one the engine was built from, per its manifest)")
    parser.add_argument("--transformers-dtype", default="bfloat16",
                        choices=("bfloat16", "float32"))
    parser.add_argument("--out", default="bench/decode/results.json")
    return parser.parse_args()


def _hf_checkpoint(engine_dir: Path, given: str | None) -> Path:
    from builder.checkpoint import resolve_checkpoint

    if given:
        return Path(given)
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    return resolve_checkpoint(manifest["spec"]["checkpoint"], log=lambda m: None)


def _build_sides(args, protocol: EngineProtocol, names: list[str], stack: list) -> dict:
    sides: dict[str, object] = {}
    if "engine" in names:
        sides["engine"] = InProcessSide(args.engine, protocol)
    for spec in args.extra_engine:
        name, _, path = spec.partition("=")
        sides[name] = InProcessSide(path, protocol)
    if "engine_process" in names:
        sides["engine_process"] = ProcessSide(args.engine, protocol)
        stack.append(sides["engine_process"])
    triton_models = [n for n in names if n in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")]
    if triton_models:
        from builder.bench.engine_level_triton import TritonSide
        from builder.repository import RepositoryOptions, emit_repository
        from builder.serving.serve import start_tritonserver

        repository = Path(tempfile.mkdtemp(prefix="bench-decode-repo-"))
        # Without KV reuse: the prompts repeat across repeats (see InProcessSide).
        emit_repository(Path(args.engine), repository,
                        RepositoryOptions(enable_kv_cache_reuse=False))
        print(f"starting tritonserver on {repository} ...", file=sys.stderr)
        server = start_tritonserver(repository, ready_timeout=900)
        stack.append(server)
        for model in triton_models:
            sides[f"triton:{model}"] = TritonSide(server.grpc_url, model, protocol)
    if "transformers" in names:
        dtype = getattr(torch, args.transformers_dtype)
        hf_dir = _hf_checkpoint(Path(args.engine), args.hf_checkpoint)
        sides[f"transformers:{args.transformers_dtype}"] = TransformersSide(hf_dir, dtype,
                                                                            protocol)
    return sides


def _medians(runs: list[dict]) -> dict:
    return {f"{level}.{key}": statistics.median(run[level][key] for run in runs)
            for level, key in METRICS}


def _print_table(medians: dict, protocol: EngineProtocol) -> None:
    n = protocol.num_prompts
    print(f"\n{'side':<26}{'TTFT c=1':>11}{'decode tok/s c=1':>18}{f'tok/s c={n}':>13}"
          f"{f'prefill {n}x{protocol.prompt_len}':>16}")
    for side, m in medians.items():
        print(f"{side:<26}{m['c1.ttft_s'] * 1e3:>8.0f} ms{m['c1.decode_tok_s']:>18.1f}"
              f"{m['cN.tok_s']:>13.1f}{m['cN.prefill_s']:>14.2f} s")


def _paired_text(ratios: list[float]) -> str:
    return (f"(repeat by repeat: median {statistics.median(ratios):.2f}x of "
            f"{', '.join(f'{r:.2f}' for r in ratios)})")


def _ratio_lines(medians: dict, runs: dict[str, list[dict]]) -> list[str]:
    lines = []
    base = medians.get("engine")
    hf = next((v for k, v in medians.items() if k.startswith("transformers")), None)
    for side in ("triton:tensorrt_llm", "triton:ensemble", "engine_process"):
        if base and side in medians:
            m = medians[side]
            pairs = _paired_text(paired_ratios(runs, side, "engine", "cN.tok_s"))
            lines.append(f"{side} vs engine: TTFT c=1 {m['c1.ttft_s'] / base['c1.ttft_s']:.2f}x, "
                         f"decode c=1 {m['c1.decode_tok_s'] / base['c1.decode_tok_s']:.2f}x, "
                         f"tok/s c=N {m['cN.tok_s'] / base['cN.tok_s']:.2f}x {pairs}")
    for side, m in medians.items():
        if hf is not None and not side.startswith(("transformers", "triton")):
            lines.append(f"{side} vs transformers: tok/s c=N {m['cN.tok_s'] / hf['cN.tok_s']:.2f}x,"
                         f" decode c=1 {m['c1.decode_tok_s'] / hf['c1.decode_tok_s']:.2f}x, "
                         f"TTFT c=1 {m['c1.ttft_s'] / hf['c1.ttft_s']:.2f}x")
        if base is not None and side not in ("engine", "engine_process") and not side.startswith(
                ("transformers", "triton")):
            pairs = _paired_text(paired_ratios(runs, side, "engine", "c1.decode_tok_s"))
            lines.append(f"{side} vs engine: decode c=1 "
                         f"{m['c1.decode_tok_s'] / base['c1.decode_tok_s']:.2f}x {pairs}, tok/s "
                         f"c=N {m['cN.tok_s'] / base['cN.tok_s']:.2f}x")
    return lines


def main() -> None:
    args = _args()
    names = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SIDES) - {"tensorrt_llm_bls"})
    if unknown:
        sys.exit(f"--sides: unknown {unknown}; known: {', '.join(SIDES)}")
    protocol = EngineProtocol(args.num_prompts, args.prompt_len, args.max_tokens, args.seed)
    config = EngineConfig.load(args.engine)
    ids_list, texts = make_prompts(load_tokenizer(args.engine, config), protocol)
    bandwidth = measure_read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}",
          file=sys.stderr)
    stack: list = []
    try:
        sides = _build_sides(args, protocol, names, stack)
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for name, side in sides.items():  # warm-up: first-call costs stay out of the figures
            side.run_one(ids_list[0][:16], texts[0][:40])
            print(f"warmed up {name}", file=sys.stderr)
        for repeat in range(args.repeats):
            # Interleaved, so drift hits every side alike: each concurrency's runs of all sides
            # back to back (the pairs `paired_ratios` divides), in an order that reverses every
            # repeat, so no side always runs first after the other concurrency's runs.
            order = list(sides.items())[::-1 if repeat % 2 else 1]
            ones = {name: measure_one(side, ids_list, texts, repeat % len(ids_list),
                                      args.ttft_samples) for name, side in order}
            for name, side in order:
                one, every = ones[name], side.run_all(ids_list, texts)
                runs[name].append({"c1": as_dict(one), "cN": as_dict(every)})
                print(f"repeat {repeat + 1}/{args.repeats} {name}: TTFT {one.ttft_s * 1e3:.0f} ms,"
                      f" decode {one.decode_tok_s:.1f} tok/s, c={protocol.num_prompts} "
                      f"{every.tok_s:.1f} tok/s", file=sys.stderr)
        roofline = {name: decode_weight_bytes(side.engine.runner.model)
                    for name, side in sides.items() if isinstance(side, InProcessSide)}
    finally:
        for item in stack:
            item.stop()
    medians = {name: _medians(r) for name, r in runs.items()}
    print(f"\n{config.name} ({config.dtype}); {protocol.num_prompts} prompts x "
          f"{protocol.prompt_len} ids, {protocol.max_tokens} new tokens each (end ids ignored); "
          f"medians of {args.repeats}; torch threads {torch.get_num_threads()}")
    _print_table(medians, protocol)
    print()
    for line in _ratio_lines(medians, runs):
        print(line)
    for name, weight_bytes in roofline.items():
        limit = bandwidth / weight_bytes
        print(f"{name}: {weight_bytes / 2**20:.0f} MiB of weights per token; roofline "
              f"{limit:.1f} tok/s at {bandwidth / 1e9:.1f} GB/s; decode c=1 at "
              f"{medians[name]['c1.decode_tok_s'] / limit:.0%} of it")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "engine": args.engine, "dtype": config.dtype, "protocol": protocol.__dict__,
        "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "read_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_token": roofline,
        "medians": medians, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

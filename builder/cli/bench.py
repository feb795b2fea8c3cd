"""`forge bench`, the one benchmark tool. Without a subcommand it measures a served endpoint (a
running Triton server or two side by side, or the one `--spec` serves for the run) with a
workload; its subcommands measure the other levels (`bench_engine`: the engine in-process;
`bench_serving`: the shape matrix against vLLM, the soak) and the features
(`bench_features`). Every one writes results.json and summary.md in one format
(`bench/summary.py`)."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Callable

import click

from builder.bench.records import RequestRecord
from builder.cli.bench_engine import COMMANDS as ENGINE_LEVEL
from builder.cli.bench_features import COMMANDS as FEATURES
from builder.cli.bench_serving import COMMANDS as SERVING

DEFAULT_OUT = "bench/latest"


class _BadInput(click.ClickException):
    exit_code = 2  # forge's exit code for bad input


def _concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise _BadInput(f"--concurrency must be a comma-separated list of integers, got {text!r}")
    if not values or min(values) < 1:
        raise _BadInput(f"--concurrency values must be >= 1, got {text!r}")
    return values


PROTOCOLS = ("grpc", "http", "openai")


def _protocols(text: str, count: int) -> list[str]:
    """One protocol for every server, or one per server (`openai,grpc` with --compare)."""
    values = [p.strip() for p in text.split(",")]
    if any(p not in PROTOCOLS for p in values) or len(values) not in (1, count):
        raise _BadInput(f"--protocol must be one of {', '.join(PROTOCOLS)}, or one per server "
                        f"with --compare (e.g. openai,grpc), got {text!r}")
    return values * count if len(values) == 1 else values


def _targets(url: str, model: str | None, protocol: str, compare: tuple[str, str] | None,
             baseline: str | None, labels: str | None, baseline_model: str | None,
             metrics: str | None = None) -> list:
    from builder.bench.runner import Target
    from builder.bench.server_stats import metrics_url

    if compare and baseline:
        raise _BadInput("give --compare A_URL B_URL or --baseline URL, not both")
    if compare:
        urls, names = list(compare), ["A", "B"]
    elif baseline:
        urls, names = [url, baseline], ["engine", "naive"]
    else:
        urls, names = [url], ["server"]
    if labels:
        names = [s.strip() for s in labels.split(",")]
        if len(names) != len(urls) or not all(names) or len(set(names)) != len(names):
            raise _BadInput(f"--labels needs {len(urls)} distinct names, got {labels!r}")
    protocols = _protocols(protocol, len(urls))
    models = [model, baseline_model or model][:len(urls)]
    scraped = [metrics_url(s.strip()) if s.strip() else None
               for s in (metrics.split(",") if metrics else [])]
    if scraped and len(scraped) != len(urls):
        raise _BadInput(f"--metrics-url needs {len(urls)} comma-separated endpoints (one per "
                        f"server, empty to skip one), got {metrics!r}")
    scraped = scraped or [None] * len(urls)
    # An OpenAI endpoint without --model measures the model it serves.
    models = [m or (None if p == "openai" else "ensemble") for m, p in zip(models, protocols)]
    return [Target(n, u, m, p, s) for n, u, m, p, s in zip(names, urls, models, protocols, scraped)]


def _progress_factory(progress: Any) -> Callable[[str, int | None], Callable[[RequestRecord], None]]:
    def factory(description: str, total: int | None) -> Callable[[RequestRecord], None]:
        task = progress.add_task(description, total=total)

        def on_done(record: RequestRecord) -> None:
            progress.advance(task)
        return on_done
    return factory


@click.group("bench", invoke_without_command=True)
@click.option("--url", default="localhost:8001", show_default=True,
              help="Server endpoint host:port (gRPC port, or the HTTP / OpenAI port).")
@click.option("--model", default=None,
              help="ensemble (default) or tensorrt_llm_bls; with --protocol openai the served "
                   "model's name (default: the one it lists).")
@click.option("--protocol", default="grpc", show_default=True,
              help="grpc, http or openai (/v1/completions); with --compare one per server, "
                   "e.g. openai,grpc.")
@click.option("--workload", default="chat", show_default=True,
              help="chat, query-rewrite, voicebot (a long shared system prompt), rewrite "
                   "(answers that copy the prompt), or a JSONL file of {prompt, max_tokens}.")
@click.option("--scale", type=float, default=1.0, show_default=True,
              help="Shrink (or grow) the built-in workload's token lengths, e.g. 0.25 on a CPU.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated levels.")
@click.option("--requests", "requests_", default=None,
              help="Requests per level: N, or Kx for K times the concurrency (default 4x).")
@click.option("--duration", type=float, default=None, help="Seconds per level instead of --requests.")
@click.option("--rate", type=float, default=None, help="Poisson arrivals, requests/s (capped by concurrency).")
@click.option("--stream/--no-stream", default=None, help="Override the workload's streaming mode.")
@click.option("--fixed-output/--no-fixed-output", default=True, show_default=True,
              help="Send min_tokens == max_tokens so every request generates max_tokens tokens.")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="Engine dir (or tokenizer dir) to fit and count tokens exactly.")
@click.option("--compare", nargs=2, default=None, metavar="A_URL B_URL",
              help="Measure two servers on the same requests, alternating; prints A/B ratios.")
@click.option("--baseline", default=None, metavar="URL|naive",
              help="Baseline server to compare --url against (labels engine, naive); `naive` "
                   "builds and serves the naive baseline of --engine's checkpoint for the run.")
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="The engine served at --url: its tokenizer, and the model of --baseline naive.")
@click.option("--spec", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve this spec's repository for the run (built when missing) with forge "
                   "serve on free loopback ports, and measure it; with --protocol openai,grpc "
                   "its two endpoints side by side.")
@click.option("--baseline-model", default=None, help="Model name on the baseline (default --model).")
@click.option("--labels", default=None, help="Names of the servers in the report, e.g. ours,naive.")
@click.option("--metrics-url", "metrics", default=None, metavar="HOST:PORT[,HOST:PORT]",
              help="Each server's metrics endpoint (forge serve: port 8002): report the prefix "
                   "cache hit rate and draft acceptance it counted during each level.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed requests per server.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds before a request is cancelled (counted as cancelled).")
@click.option("--keep-text", is_flag=True, help="Store every output text in results.json.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=DEFAULT_OUT,
              show_default=True)
@click.option("--plots/--no-plots", default=True, show_default=True)
@click.pass_context
def bench_command(ctx, url, model, protocol, workload, scale, seed, concurrency, requests_,
                  duration, rate, stream, fixed_output, tokenizer, compare, baseline, engine_dir,
                  spec, baseline_model, labels, metrics, warmup, timeout, keep_text, out_dir,
                  plots) -> None:
    """Served: drive a running server with WORKLOAD at each concurrency; print a table, write
    results.json (every request's timings), summary.md and PNG plots into --out. The
    subcommands measure the engine in-process and the features."""
    if ctx.invoked_subcommand:
        return
    from rich.console import Console

    from builder.bench.runner import BenchSettings
    from builder.bench.workloads import build_workload, load_tokenizer

    if requests_ is not None and duration is not None:
        raise _BadInput("give --requests or --duration, not both")
    if baseline == "naive" and protocol not in ("grpc", "http"):
        raise _BadInput("--baseline naive serves Triton only: use --protocol grpc or http")
    if baseline == "naive" and not (engine_dir or spec):
        raise _BadInput("--baseline naive needs --engine DIR (the engine served at --url)")
    if spec and compare:
        raise _BadInput("give --spec or --compare, not both")
    levels = _concurrencies(concurrency)
    settings = BenchSettings(levels, requests_ or (None if duration else "4x"), duration, rate,
                             warmup, timeout, fixed_output, seed, keep_text)
    two_paths = bool(spec) and "," in protocol  # the served spec's two endpoints
    _targets(url, model, protocol, ("a", "b") if two_paths else compare, baseline, labels,
             baseline_model, metrics)  # early
    # Piped or redirected, rich would cut the tables to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if spec:
        from builder.bench.servers import ensure_repository

        spec_engine, repository = ensure_repository(spec, console.print)
        engine_dir = engine_dir or str(spec_engine)
    try:
        counts = [settings.num_requests(c) for c in levels]
        num_items = max(counts) if duration is None else 256
        tokenizer = tokenizer or engine_dir
        tok = load_tokenizer(tokenizer) if tokenizer else None
        wl = build_workload(workload, num_items, seed, scale, tok, stream)
    except ValueError as exc:
        raise _BadInput(str(exc))
    with contextlib.ExitStack() as stack:
        if spec:
            url, compare, labels = _serve_for_the_run(stack, repository, protocol, labels,
                                                      Path(out_dir), console)
        if baseline == "naive":
            from builder.bench.baseline import serve_naive_baseline

            try:
                server = stack.enter_context(serve_naive_baseline(engine_dir, console.print))
            except ValueError as exc:
                raise _BadInput(str(exc))
            baseline = server.grpc_url if protocol == "grpc" else server.http_url
        targets = _targets(url, model, protocol, compare, baseline, labels, baseline_model,
                           metrics)
        _run_and_report(console, targets, wl, settings, tok, Path(out_dir), plots)


def _serve_for_the_run(stack: contextlib.ExitStack, repository: Path, protocol: str,
                       labels: str | None, out: Path, console: Any) -> tuple:
    """`forge serve` of the spec's repository until the run ends: (--url, --compare, --labels)
    on it, its two paths compared when two protocols are given."""
    from builder.bench.servers import forge_serve

    out.mkdir(parents=True, exist_ok=True)
    server, endpoints = forge_serve(repository, out / "forge-serve.log")
    stack.callback(server.stop)
    console.print(f"serving {repository}: gRPC {endpoints.grpc}, HTTP {endpoints.http}, "
                  f"OpenAI {endpoints.openai}, metrics {endpoints.metrics}")
    paths = protocol.split(",")
    if len(paths) == 2:
        return endpoints.url(paths[0]), tuple(endpoints.url(p) for p in paths), labels or protocol
    return endpoints.url(paths[0]), None, labels


def _run_and_report(console: Any, targets: list, wl: Any, settings: Any, tok: Any, out: Path,
                    plots: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from builder.bench import plots as plot_mod
    from builder.bench.report import refresh, write_results
    from builder.bench.runner import run_bench
    from builder.bench.summary import finish

    console.print(f"[bold]forge bench[/] {wl.name}: {len(wl.items)} distinct requests, "
                  f"levels {list(settings.concurrencies)} on {', '.join(t.label + '=' + t.url for t in targets)}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        try:
            result = run_bench(targets, wl, settings, tok, _progress_factory(progress),
                               on_level=lambda partial: write_results(partial, out))
        except ValueError as exc:
            raise _BadInput(str(exc))
    finish(refresh(result), out, console)
    if plots:
        for png in plot_mod.write_plots(result, out):
            console.print(f"plot: {png}")


for _command in (*ENGINE_LEVEL, *FEATURES, *SERVING):
    bench_command.add_command(_command)

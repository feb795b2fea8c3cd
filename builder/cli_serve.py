"""`forge repository`, `forge serve` and `forge query`: emit, serve and query the Triton repository."""
from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

EXIT_BAD_INPUT = 2


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.command("repository")
@click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False))
@click.option("--output", "output_dir", required=True, type=click.Path(file_okay=False))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="A RepositoryOptions field, e.g. --set decoupled=false (repeatable).")
def repository_command(engine_dir, output_dir, settings) -> None:
    """Re-emit the Triton model repository for an engine directory."""
    import yaml

    from builder.repository import RepositoryOptions, emit_repository

    try:
        values = {}
        for item in settings:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            values[key.strip()] = yaml.safe_load(raw)
        path = emit_repository(Path(engine_dir), Path(output_dir),
                               RepositoryOptions.from_dict(values))
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    click.echo(f"repository: {path}")


@click.command("serve")
@click.option("--repository", "repository_dir", required=True, type=click.Path(file_okay=False))
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@click.option("--demo-prompt", help="Stream this prompt through the ensemble once, then stop.")
@click.option("--demo-max-tokens", type=int, default=64, show_default=True)
def serve_command(repository_dir, http_port, grpc_port, metrics_port, ready_timeout, demo_prompt,
                  demo_max_tokens) -> None:
    """Start tritonserver on loopback for a repository; stop it with Ctrl-C or SIGTERM."""
    from builder.serve import engine_report, start_tritonserver

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = start_tritonserver(repository_dir, http_port=http_port, grpc_port=grpc_port,
                                    metrics_port=metrics_port, ready_timeout=ready_timeout)
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        _fail(str(exc), code=1)
    try:
        click.echo(f"tritonserver ready (log: {server.log_path})")
        click.echo(f"  HTTP     http://{server.http_url}")
        click.echo(f"  gRPC     {server.grpc_url}")
        click.echo(f"  metrics  {server.metrics_url}")
        report = engine_report(server.metrics_url)
        if report:
            click.echo(report)
        click.echo("try:")
        click.echo(f"  curl -s -X POST http://{server.http_url}/v2/models/ensemble/generate "
                   "-d '{\"text_input\": \"What is Triton?\", \"max_tokens\": 32}'")
        if demo_prompt:
            _demo(server, demo_prompt, demo_max_tokens)
            return
        while not stop.wait(1.0):
            if not server.is_alive():
                _fail(f"tritonserver exited:\n{server.log_tail()}", code=1)
    finally:
        click.echo("stopping tritonserver")
        server.stop()


def _demo(server, prompt: str, max_tokens: int) -> None:
    from builder.client import decode_text, stream_grpc, text_inputs

    click.echo(f"\n>>> {prompt}")
    inputs = text_inputs(text_input=prompt, max_tokens=max_tokens, stream=True)
    for chunk in stream_grpc(server.grpc_url, "ensemble", inputs):
        click.echo(decode_text(chunk), nl=False)
    click.echo("\n")


@click.command("query")
@click.argument("prompt")
@click.option("--url", default=None, help="host:port (default: localhost:8001 gRPC, :8000 HTTP)")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--stream/--no-stream", default=False, show_default=True)
@click.option("--model", type=click.Choice(["ensemble", "tensorrt_llm_bls"]), default="ensemble",
              show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float)
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--seed", type=int)
@click.option("--stop-word", "stop_words", multiple=True)
def query_command(prompt, url, protocol, stream, model, max_tokens, temperature, top_k, top_p,
                  seed, stop_words) -> None:
    """Send one prompt to a running server and print the text (as it streams with --stream)."""
    from builder.client import decode_text, generate_http, stream_grpc, text_inputs

    url = url or ("127.0.0.1:8001" if protocol == "grpc" else "127.0.0.1:8000")
    values = dict(text_input=prompt, max_tokens=max_tokens, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, stop_words=list(stop_words) or None)
    try:
        if protocol == "grpc":
            for chunk in stream_grpc(url, model, text_inputs(stream=stream, **values)):
                click.echo(decode_text(chunk), nl=False)
        else:
            payload = {k: v for k, v in values.items() if v is not None}
            payload["stream"] = stream
            for event in generate_http(url, model, payload, stream=stream):
                click.echo(event["text_output"], nl=False)
        click.echo()
    except RuntimeError as exc:
        _fail(str(exc))
    except Exception as exc:  # connection refused and friends
        _fail(f"{url}: {type(exc).__name__}: {exc}", code=1)

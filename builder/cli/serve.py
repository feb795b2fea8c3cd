"""`forge serve`: tritonserver for a repository, supervised, with probes, until drained."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import click

from builder.errors import EXIT_INTERNAL, fail
from builder.serving.addresses import LOOPBACK, bind_address, check_port_free
from builder.serving.health import (DEFAULT_HEALTH_PORT, LIVENESS_PATH, READINESS_PATH,
                                    STARTUP_PATH, HealthState)
from builder.serving.allocator import ALLOCATOR_PACKAGES, MALLOC_CHOICES

API_KEY_ENV = "LLM_FORGE_API_KEY"


@click.command("serve")
@click.option("--repository", "repository_dir", required=True,
              type=click.Path(exists=True, file_okay=False))  # a missing one is bad input: exit 2
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@click.option("--demo-prompt", help="Stream this prompt through the ensemble once, then stop.")
@click.option("--demo-max-tokens", type=int, default=64, show_default=True)
@click.option("--openai-port", type=int, default=None,
              help="Also serve the OpenAI-compatible API on this port (0: a free one).")
@click.option("--host", default=LOOPBACK, show_default=True,
              help="Address the OpenAI-compatible API and the health port bind to (0.0.0.0 "
                   "in a pod).")
@click.option("--openai-triton-model",
              type=click.Choice(["tensorrt_llm", "ensemble", "tensorrt_llm_bls"]),
              default="tensorrt_llm", show_default=True,
              help="The model the OpenAI API calls: tensorrt_llm with token ids (the API "
                   "tokenizes and detokenizes), or the ensemble / BLS with text.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None,
              help="Clients of the OpenAI API must send this key as a bearer token (401 "
                   "otherwise); also read from LLM_FORGE_API_KEY. An empty key (flag or "
                   "variable) is refused (exit 2). Triton's own ports take no key: they bind "
                   "loopback unless --triton-host says otherwise.")
@click.option("--openai-max-concurrent-requests", type=int, default=256, show_default=True,
              help="Requests in flight on the OpenAI API; more get HTTP 429.")
@click.option("--drain-timeout", type=click.FloatRange(0, 3600), default=30.0,
              show_default=True,
              help="On SIGTERM or Ctrl-C, seconds requests in flight may take to finish; then "
                   "they are cancelled (each ends with its final response).")
@click.option("--max-reloads", type=click.IntRange(0, 100), default=3, show_default=True,
              help="Reloads of a model that cannot serve (tensorrt_llm; preprocessing, "
                   "postprocessing or the BLS with a dead stub), within 5 minutes, before the "
                   "supervisor gives up and leaves the server not ready.")
@click.option("--malloc", type=click.Choice(MALLOC_CHOICES),
              default="auto", show_default=True,
              help="The allocator tritonserver and its stubs run with: auto takes jemalloc, "
                   "else tcmalloc, if installed (glibc's malloc keeps every peak's memory).")
@click.option("--health-port", type=click.IntRange(0, 65535), default=DEFAULT_HEALTH_PORT,
              show_default=True,
              help="forge serve's probes (GET /health/startup, /health/ready, /health/live) and "
                   "POST /drain (loopback clients only), bound to --host (0: a free port).")
@click.option("--triton-host", default=LOOPBACK, show_default=True,
              help="Address Triton's HTTP and gRPC ports bind to. They take no key: open them "
                   "only behind a network policy.")
@click.option("--metrics-host", default=LOOPBACK, show_default=True,
              help="Address Triton's metrics port binds to (0.0.0.0 in a pod, for Prometheus "
                   "and the gateway's endpoint picker).")
def serve_command(repository_dir, http_port, grpc_port, metrics_port, ready_timeout, demo_prompt,
                  demo_max_tokens, openai_port, host, openai_triton_model, api_key,
                  openai_max_concurrent_requests, drain_timeout, max_reloads, malloc,
                  health_port, triton_host, metrics_host) -> None:
    """Start tritonserver for a repository and supervise it, with probes on the health port;
    Ctrl-C, SIGTERM or `forge drain` drain it and exit 0; exit 1 if tritonserver itself dies."""
    from builder.repository.device import check_servable
    from builder.serving.serve import start_tritonserver

    api_key = checked_api_key(api_key, click.get_current_context())
    try:  # a GPU engine where no GPU is visible: said before any port opens
        check_servable(Path(repository_dir))
    except ValueError as exc:
        fail(str(exc))
    health, stop = HealthState(), threading.Event()

    def begin_drain() -> None:  # SIGTERM, Ctrl-C and POST /drain alike
        health.begin_drain()
        stop.set()

    health_server = _open_ports(health, begin_drain, host, health_port, openai_port,
                                (triton_host, http_port, grpc_port), (metrics_host, metrics_port))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: begin_drain())
    try:
        try:
            server = start_tritonserver(
                repository_dir, http_port=http_port, grpc_port=grpc_port,
                metrics_port=metrics_port, ready_timeout=ready_timeout,
                drain_timeout=drain_timeout, malloc=malloc, triton_host=triton_host,
                metrics_host=metrics_host)
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            fail(str(exc), code=EXIT_INTERNAL)
        with _stopping(server) as parts:
            _print_endpoints(server, repository_dir, malloc, health_server.url)
            if demo_prompt:
                _demo(server, demo_prompt, demo_max_tokens)
                return
            if openai_port is not None:
                parts.openai = _start_openai(repository_dir, server, openai_port, host,
                                             openai_triton_model,
                                             openai_max_concurrent_requests, api_key)
            parts.supervisors = _start_supervisors(server, Path(repository_dir), max_reloads,
                                                   health)
            health.mark_started()
            _serve(server, parts, health, stop, drain_timeout)
    finally:
        health_server.stop()


def checked_api_key(api_key: str | None, ctx: click.Context) -> str | None:
    """The API key, or None when none was given; exit 2 for an empty one. click reads an empty
    variable as unset, so `LLM_FORGE_API_KEY=""` (a Secret made from an unset shell variable)
    would otherwise serve every client without a key."""
    from_flag = ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE
    if from_flag and (api_key is None or not api_key.strip()):
        fail("--api-key: must not be empty (leave the flag out to serve without a key)")
    if not from_flag and api_key is None and API_KEY_ENV in os.environ:
        fail(f"{API_KEY_ENV} is set but empty: set it to the key clients must send, or unset "
             f"it to serve without a key (in a pod: the Secret's api-key is empty)")
    if api_key is not None and not api_key.strip():
        fail(f"{API_KEY_ENV}: must not be blank (it holds only whitespace)")
    return api_key


def _open_ports(health: HealthState, on_drain, host: str, health_port: int,
                openai_port: int | None, triton: tuple[str, int, int], metrics: tuple[str, int]):
    """The health port, listening before tritonserver starts (its startup probe answers 503
    while the models load), once every address is checked; then the other ports checked free.
    Exit 2 naming the option otherwise."""
    from builder.serving.health_server import HealthServer

    (triton_host, http_port, grpc_port), (metrics_host, metrics_port) = triton, metrics
    try:
        for value, option in ((host, "--host"), (triton_host, "--triton-host"),
                              (metrics_host, "--metrics-host")):
            bind_address(value, option)
    except ValueError as exc:
        fail(str(exc))
    try:
        health_server = HealthServer(health, host, health_port, on_drain)
    except OSError as exc:
        fail(f"--health-port {health_port}: cannot bind {host}:{health_port} "
             f"({exc.strerror or exc}); another server holds it? (0 picks a free port)")
    try:
        for bound, port, option in ((triton_host, http_port, "--http-port"),
                                    (triton_host, grpc_port, "--grpc-port"),
                                    (metrics_host, metrics_port, "--metrics-port"),
                                    (host, openai_port or 0, "--openai-port")):
            check_port_free(bound, port, option)
    except ValueError as exc:
        health_server.stop()
        fail(str(exc))
    return health_server


def _print_endpoints(server, repository_dir, malloc: str, health_url: str) -> None:
    from builder.serving.serve import engine_report

    click.echo(f"tritonserver ready (log: {server.log_path})")
    click.echo(f"  HTTP     http://{server.http_url}{_bound(server.triton_host)}")
    click.echo(f"  gRPC     {server.grpc_url}{_bound(server.triton_host)}")
    click.echo(f"  metrics  {server.metrics_url}{_bound(server.metrics_host)}")
    click.echo(f"  health   {health_url}{STARTUP_PATH} {READINESS_PATH} {LIVENESS_PATH} "
               f"(POST /drain from loopback: forge drain)")
    hint = (f" (glibc's; apt-get install {ALLOCATOR_PACKAGES['jemalloc']} keeps memory "
            "flat under load)"
            if server.allocator == "system" and malloc == "auto" else "")
    click.echo(f"  malloc   {server.allocator}{hint}")
    click.echo(served_engine_line(repository_dir))
    report = engine_report(server.metrics_url)
    if report:
        click.echo(report)
    click.echo("try:")  # a chat model answers a bare question with its end token at once
    click.echo(f"  curl -s -X POST http://{server.http_url}/v2/models/ensemble/generate "
               "-d '{\"text_input\": \"What is the capital of France?\", \"max_tokens\": 32, "
               "\"apply_chat_template\": true}'")


def _bound(host: str) -> str:
    return "" if host == LOOPBACK else f" (bound to {host})"


def _serve(server, parts: "_Parts", health: HealthState, stop: threading.Event,
           drain_timeout: float) -> None:
    """Serve until `stop` (SIGTERM, Ctrl-C, POST /drain), then drain; exit 1 if tritonserver or
    the OpenAI server dies."""
    from builder.serving.drain import drain, unload_models
    from builder.serving.supervisor import stop_supervisors

    while not stop.wait(1.0):
        if not server.is_alive():
            fail(f"tritonserver exited with code {server.process.returncode}:\n"
                 f"{server.log_tail()}", code=EXIT_INTERNAL)
        if parts.openai is not None and not parts.openai.is_alive():
            fail("the OpenAI server stopped", code=EXIT_INTERNAL)
    stop_supervisors(parts.supervisors, report=click.echo)
    click.echo(f"draining: no new requests; requests in flight may finish within "
               f"{drain_timeout:g} s")
    drain(server, drain_timeout, report=click.echo)
    parts.unloaded = unload_models(server, report=click.echo)
    health.mark_drained()


class _Parts:
    """What runs beside tritonserver: the OpenAI server and the supervisors."""

    def __init__(self) -> None:
        self.openai = None
        self.supervisors: list = []
        self.unloaded = False  # every model unloaded after the drain (TritonServer.stop)


@contextlib.contextmanager
def _stopping(server):
    """Whatever happens inside, nothing reloads afterwards and everything stops, reported."""
    parts = _Parts()
    try:
        yield parts
    finally:
        for supervisor in parts.supervisors:
            supervisor.halt()  # a failed start or drain: nothing may reload what is stopping
        if parts.openai is not None:
            click.echo("stopping the OpenAI server")
            parts.openai.stop()
        click.echo("stopping tritonserver")
        stopping = time.monotonic()
        server.stop(unloaded=parts.unloaded)
        click.echo(f"tritonserver stopped in {time.monotonic() - stopping:.1f} s")
        stuck = server.stuck_at_exit()
        if server.killed_after_unload:
            click.echo("tritonserver still ran after every model was unloaded: Triton 2.51 never "
                       "unloads a model version whose stub died after a request reached it; "
                       "killed it")
        elif stuck:
            click.echo(f"warning: tritonserver stopped at its exit timeout: {stuck} "
                       f"(log: {server.log_path})", err=True)


def _start_supervisors(server, repository_dir: Path, max_reloads: int, health) -> list:
    """One supervisor per Python model of the repository. Only `tensorrt_llm` (the engine) is
    reloaded when it stops answering; the others only when their stub is dead (an inconclusive
    answer from them never reloads anything)."""
    import math

    from builder.serving.supervisor import Supervisor, supervised_models

    models = supervised_models(repository_dir)
    supervisors = [Supervisor(server.http_url, model=model, max_reloads=max_reloads,
                              hung_seconds=30.0 if model == "tensorrt_llm" else math.inf,
                              health=health, report=click.echo) for model in models]
    for supervisor in supervisors:
        supervisor.start()
    if not supervisors:
        return supervisors
    click.echo(f"supervisor: probing {', '.join(models)} every {supervisors[0].period:g} s; "
               f"at most {max_reloads} reloads of each within 5 minutes")
    return supervisors


def served_engine_line(repository_dir) -> str:
    """Which engine the repository serves (tensorrt_llm's engine_dir; the other models use its
    tokenizer), with its dtype and quantization, so a repointed repository shows at once."""
    from builder.repository.target import served_engine
    from triton_backend.engine.config import EngineConfig

    engine = served_engine(Path(repository_dir))
    if engine is None:
        return "  engine   (no tensorrt_llm model in the repository)"
    try:
        config = EngineConfig.load(engine)
    except (OSError, ValueError) as exc:
        return f"  engine   {engine} (unreadable: {exc})"
    quant = config.quantization
    return (f"  engine   {engine} ({config.target}, {config.dtype}, weights "
            f"{quant.weights}, KV cache {quant.kv_cache}): tensorrt_llm, ensemble, BLS")


def _start_openai(repository_dir, server, port, host, triton_model, max_concurrent_requests,
                  api_key):
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server

    try:
        config = OpenAIServerConfig.from_repository(
            repository_dir, server.grpc_url, host=host, port=port, triton_model=triton_model,
            max_concurrent_requests=max_concurrent_requests, api_key=api_key)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    try:
        openai = start_openai_server(config)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc), code=EXIT_INTERNAL)
    key = " (API key required)" if api_key else ""
    click.echo(f"OpenAI API ready: {openai.base_url} (model {config.model_name!r}){key}")
    auth = " -H 'Authorization: Bearer $LLM_FORGE_API_KEY'" if api_key else ""
    click.echo(f"  curl -s {openai.base_url}/chat/completions{auth} -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"{config.model_name}\", \"messages\": [{{\"role\": \"user\", "
               f"\"content\": \"What is the capital of France?\"}}]}}'")
    return openai


def _demo(server, prompt: str, max_tokens: int) -> None:
    from builder.client import decode_text, stream_grpc, text_inputs

    click.echo(f"\n>>> {prompt}")
    inputs = text_inputs(text_input=prompt, max_tokens=max_tokens, stream=True)
    for chunk in stream_grpc(server.grpc_url, "ensemble", inputs):
        click.echo(decode_text(chunk), nl=False)
    click.echo("\n")

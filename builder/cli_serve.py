"""`forge repository`, `forge serve` and `forge query`: emit, serve and query the Triton repository."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import click

from builder.errors import EXIT_INTERNAL, fail
from builder.serving.serve import ALLOCATOR_PACKAGES, MALLOC_CHOICES

@click.command("repository")
@click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False))
@click.option("--output", "output_dir", required=True, type=click.Path(file_okay=False))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="A field of the spec's repository: or serving: section, e.g. --set "
                   "decoupled=false or --set max_waiting_requests=16 (repeatable).")
def repository_command(engine_dir, output_dir, settings) -> None:
    """Re-emit the Triton model repository for an engine directory, from the repository: and
    serving: sections of the spec it was built with, changed by --set."""
    import dataclasses

    import yaml

    from builder.manifest import spec_serving_sections
    from builder.repository import RepositoryOptions, emit_repository
    from builder.spec import ServingSpec

    serving_keys = {f.name for f in dataclasses.fields(ServingSpec)}
    repository, serving = spec_serving_sections(Path(engine_dir))
    try:
        for item in settings:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            key = key.strip()
            (serving if key in serving_keys else repository)[key] = yaml.safe_load(raw)
        path = emit_repository(Path(engine_dir), Path(output_dir),
                               RepositoryOptions.from_dict(repository), ServingSpec(**serving))
    except (ValueError, FileNotFoundError) as exc:  # SpecError is a ValueError
        fail(str(exc))
    click.echo(f"repository: {path}")
    for line in adapter_lines(Path(engine_dir)):
        click.echo(line)


def adapter_lines(engine_dir: Path) -> list[str]:
    """The LoRA adapters an engine serves: the model name and lora_task_id of each."""
    from triton_backend.engine.config import EngineConfig

    lora = EngineConfig.load(engine_dir).lora
    if lora is None:
        return []
    lines = [f"LoRA adapters (max_rank {lora.max_rank}, {lora.max_loras} resident, "
             f"{lora.max_cpu_loras} cached; more can be sent as lora_weights + lora_config):"]
    lines += [f"  {a.name}: lora_task_id {a.task_id}, rank {a.rank}, "
              f"{', '.join(a.target_modules)}" for a in lora.adapters]
    return lines


@click.command("serve")
@click.option("--repository", "repository_dir", required=True, type=click.Path(file_okay=False))
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True)
@click.option("--demo-prompt", help="Stream this prompt through the ensemble once, then stop.")
@click.option("--demo-max-tokens", type=int, default=64, show_default=True)
@click.option("--openai-port", type=int, default=None,
              help="Also serve the OpenAI-compatible API on this port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the OpenAI-compatible API binds to.")
@click.option("--openai-triton-model",
              type=click.Choice(["tensorrt_llm", "ensemble", "tensorrt_llm_bls"]),
              default="tensorrt_llm", show_default=True,
              help="The model the OpenAI API calls: tensorrt_llm with token ids (the API "
                   "tokenizes and detokenizes), or the ensemble / BLS with text.")
@click.option("--api-key", envvar="LLM_FORGE_API_KEY", default=None,
              help="Clients of the OpenAI API must send this key as a bearer token (401 "
                   "otherwise); also read from LLM_FORGE_API_KEY. Triton's own ports take no "
                   "key: they bind loopback.")
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
def serve_command(repository_dir, http_port, grpc_port, metrics_port, ready_timeout, demo_prompt,
                  demo_max_tokens, openai_port, host, openai_triton_model, api_key,
                  openai_max_concurrent_requests, drain_timeout, max_reloads, malloc) -> None:
    """Start tritonserver on loopback for a repository and supervise it; Ctrl-C or SIGTERM drain
    it and exit 0; exit 1 if tritonserver itself dies."""
    from builder.serving.serve import engine_report, start_tritonserver

    stop, openai, supervisors = threading.Event(), None, []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = start_tritonserver(repository_dir, http_port=http_port, grpc_port=grpc_port,
                                    metrics_port=metrics_port, ready_timeout=ready_timeout,
                                    drain_timeout=drain_timeout, malloc=malloc)
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        fail(str(exc), code=EXIT_INTERNAL)
    try:
        click.echo(f"tritonserver ready (log: {server.log_path})")
        click.echo(f"  HTTP     http://{server.http_url}")
        click.echo(f"  gRPC     {server.grpc_url}")
        click.echo(f"  metrics  {server.metrics_url}")
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
        if demo_prompt:
            _demo(server, demo_prompt, demo_max_tokens)
            return
        if openai_port is not None:
            openai = _start_openai(repository_dir, server, openai_port, host, openai_triton_model,
                                   openai_max_concurrent_requests, api_key)
        supervisors = _start_supervisors(server, Path(repository_dir), max_reloads)
        while not stop.wait(1.0):
            if not server.is_alive():
                fail(f"tritonserver exited with code {server.process.returncode}:\n"
                      f"{server.log_tail()}", code=EXIT_INTERNAL)
            if openai is not None and not openai.is_alive():
                fail("the OpenAI server stopped", code=EXIT_INTERNAL)
        from builder.serving.supervisor import drain, stop_supervisors

        stop_supervisors(supervisors, report=click.echo)
        click.echo(f"draining: no new requests; requests in flight may finish within "
                   f"{drain_timeout:g} s")
        drain(server, drain_timeout, report=click.echo)
    finally:
        for supervisor in supervisors:
            supervisor.halt()  # a failed start or drain: nothing may reload what is stopping
        if openai is not None:
            click.echo("stopping the OpenAI server")
            openai.stop()
        click.echo("stopping tritonserver")
        stopping = time.monotonic()
        server.stop()
        click.echo(f"tritonserver stopped in {time.monotonic() - stopping:.1f} s")
        stuck = server.stuck_at_exit()
        if stuck:
            click.echo(f"warning: tritonserver stopped at its exit timeout: {stuck} "
                       f"(log: {server.log_path})", err=True)


def _start_supervisors(server, repository_dir: Path, max_reloads: int) -> list:
    """One supervisor per Python model of the repository. Only `tensorrt_llm` (the engine) is
    reloaded when it stops answering; the others only when their stub is dead (an inconclusive
    answer from them never reloads anything)."""
    import math

    from builder.serving.supervisor import Supervisor, supervised_models

    models = supervised_models(repository_dir)
    supervisors = [Supervisor(server.http_url, model=model, max_reloads=max_reloads,
                              hung_seconds=30.0 if model == "tensorrt_llm" else math.inf,
                              report=click.echo) for model in models]
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
    from builder.repository_target import served_engine
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
@click.option("--chat", is_flag=True,
              help="Send the prompt as a user message of the model's chat template.")
def query_command(prompt, url, protocol, stream, model, max_tokens, temperature, top_k, top_p,
                  seed, stop_words, chat) -> None:
    """Send one prompt to a running server and print the text (as it streams with --stream)."""
    from builder.client import decode_text, generate_http, stream_grpc, text_inputs

    url = url or ("127.0.0.1:8001" if protocol == "grpc" else "127.0.0.1:8000")
    values = dict(text_input=prompt, max_tokens=max_tokens, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, stop_words=list(stop_words) or None,
                  apply_chat_template=True if chat else None)
    printed = 0
    try:
        if protocol == "grpc":
            for chunk in stream_grpc(url, model, text_inputs(stream=stream, **values)):
                text = decode_text(chunk)
                printed += len(text)
                click.echo(text, nl=False)
        else:
            payload = {k: v for k, v in values.items() if v is not None}
            payload["stream"] = stream
            for event in generate_http(url, model, payload, stream=stream):
                printed += len(event["text_output"])
                click.echo(event["text_output"], nl=False)
        click.echo()
        if not printed and not chat:  # an instruct model ends a bare question at once
            click.echo("(the answer is empty: the model ended at once; a chat model answers "
                       "questions asked as a chat turn: --chat)", err=True)
    except RuntimeError as exc:
        fail(str(exc))
    except Exception as exc:  # connection refused and friends
        fail(f"{url}: {type(exc).__name__}: {exc}", code=EXIT_INTERNAL)

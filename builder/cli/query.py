"""`forge query`: send one prompt to a running server."""
from __future__ import annotations

import click

from builder.errors import EXIT_INTERNAL, fail


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
    except ConnectionError as exc:  # the same words for gRPC and HTTP
        fail(f"{exc}; start one (`make serve`) or name its port with --url", code=EXIT_INTERNAL)
    except RuntimeError as exc:
        fail(str(exc))
    except Exception as exc:
        fail(f"{url}: {type(exc).__name__}: {exc}", code=EXIT_INTERNAL)

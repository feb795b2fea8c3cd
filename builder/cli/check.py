"""`forge check`: re-run the quality gate of a built engine, optionally on the user's own text."""
from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from builder.errors import cli_errors
from triton_backend.engine.config import MANIFEST_FILE


def reference_checkpoint(engine_dir: Path, reference: str | None) -> Path:
    """The unquantized source: --reference, else the checkpoint the manifest records."""
    from builder.pipeline.checkpoint import resolve_checkpoint

    if reference:
        return resolve_checkpoint(reference, lambda message: None)
    manifest = engine_dir / MANIFEST_FILE
    source = json.loads(manifest.read_text()).get("spec", {}).get("checkpoint") \
        if manifest.is_file() else None
    if not source:
        raise ValueError(f"{engine_dir}: no manifest names the source checkpoint; pass --reference")
    return resolve_checkpoint(source, lambda message: None)


def previous_thresholds(engine_dir: Path) -> dict:
    """The thresholds the build gated with (from its quality.json), so a re-check is like for
    like; except a quick build gate's `quick`: a re-check runs the full gate unless told not to."""
    from builder.quality.gate import QUALITY_FILE

    path = engine_dir / QUALITY_FILE
    section = dict(json.loads(path.read_text()).get("thresholds", {})) if path.is_file() else {}
    section.pop("quick", None)
    return section


@click.command("check")
@click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False),
              help="A built engine directory.")
@click.option("--data", type=click.Path(dir_okay=False),
              help="Held-out text (.txt paragraphs or .jsonl with 'text'); default: the built-in "
                   "held-out text.")
@click.option("--reference", help="Unquantized source checkpoint (default: the one it was built from).")
@click.option("--threshold", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a quality threshold, e.g. min_top1_agreement=0.9 (repeatable).")
@click.option("--quick", is_flag=True,
              help="A quick gate: a fraction of the windows, prompts and questions, reported as "
                   "such (for trying things; not the full gate).")
def check_command(engine_dir, data, reference, overrides, quick) -> None:
    """Evaluate an engine against its unquantized source; exit 3 when a threshold is crossed."""
    from builder.quality.gate import run_quality_gate
    from builder.quality.metrics import QualityThresholds
    from triton_backend.engine.config import EngineConfig

    with cli_errors():
        engine = Path(engine_dir)
        EngineConfig.load(engine)  # a clear error when this is not an engine directory
        section = previous_thresholds(engine)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--threshold {item!r}: expected KEY=VALUE")
            section[key] = None if value.lower() == "none" else yaml.safe_load(value)
        if data:
            section["dataset"] = data
        if quick:
            section["quick"] = True
        thresholds = QualityThresholds.from_spec(section)
        hf_dir = reference_checkpoint(engine, reference)
        click.echo(f"checking {engine} against {hf_dir}", err=True)
        run_quality_gate(engine, hf_dir, thresholds,
                         progress=lambda message: click.echo(f"  {message}", err=True),
                         echo=click.echo)

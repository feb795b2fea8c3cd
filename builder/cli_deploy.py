"""`forge deploy`: Kubernetes manifests for a spec's engine (see docs/deploy.md)."""
from __future__ import annotations

from pathlib import Path

import click

from builder.errors import cli_errors


@click.command("deploy")
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="Build spec with a deployment: section.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the manifests and kustomization.yaml.")
def deploy_command(spec_path, out_dir) -> None:
    """Render the spec's deployment: a Deployment with probes and a preStop drain, Service,
    PodDisruptionBudget, NetworkPolicy, an autoscaler on LLM load (KEDA or HPA), a
    ServiceMonitor, an InferencePool and its endpoint picker, plus kustomization.yaml.
    Exit 2 on a spec error, naming the field."""
    from builder.deploy.render import write_manifests
    from builder.spec import load_spec

    with cli_errors():
        spec = load_spec(spec_path)
        written = write_manifests(spec, Path(out_dir))
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(f"apply: kubectl apply -k {out_dir}")

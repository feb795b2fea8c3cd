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
    The pod's memory is computed from the engine (weights, KV cache, runtime, peak, 25%
    headroom) unless the spec gives it. Exit 2 on a spec error, naming the field."""
    from builder.deploy.context import deploy_context
    from builder.deploy.render import write_manifests
    from builder.spec.load import load_spec

    with cli_errors():
        spec = load_spec(spec_path)
        ctx = deploy_context(spec)
        written = write_manifests(ctx, Path(out_dir))
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(memory_line(ctx))
    for line in next_steps(ctx, out_dir):
        click.echo(line)


def memory_line(ctx) -> str:
    """What the pod's memory request and limit are, and where they come from."""
    request, limit = ctx.memory
    estimate = ctx.memory_estimate
    given = ctx.deployment.resources.memory_limit is not None
    if estimate is not None and not given:
        return f"memory: {estimate.describe()} (request = limit)"
    if estimate is not None:
        return (f"memory: request {request}, limit {limit} (the spec's; the engine needs "
                f"{estimate.describe()})")
    where = f"target {ctx.spec.target} on {ctx.spec.hardware}"
    return (f"memory: request {request}, limit {limit} (the spec's or the default: not computed "
            f"for {where}, where the engine is not in the pod's memory)")


def next_steps(ctx, out_dir: str) -> list[str]:
    """The commands that follow: the API key's Secret where forge serve runs (it refuses an
    empty key, so the pod would not start), then the apply."""
    steps = []
    if not ctx.multi_rank:
        d = ctx.deployment
        steps += [f"secret: KEY=$(openssl rand -hex 24); test -n \"$KEY\" && kubectl -n "
                  f"{d.namespace} create secret generic {d.api_key_secret} "
                  f"--from-literal=api-key=\"$KEY\"",
                  "        (clients send it as a bearer token; an empty key keeps the pod "
                  "from starting: forge serve exits 2)"]
    steps.append(f"apply: kubectl apply -k {out_dir}")
    return steps

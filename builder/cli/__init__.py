"""`forge`: the command line. Each command lives in its own module; this file only gathers them.

Exit codes: 0 ok, 1 internal error, 2 bad input (the message names the field and the limit),
3 quality gate failed, 4 `forge engine --check` found the engine out of date.
"""
from __future__ import annotations

import click

from builder import __version__
from builder.cli.bench import bench_command
from builder.cli.deploy import deploy_command
from builder.cli.engine import engine_command, generate_command
from builder.cli.gpu_check import gpu_check_command
from builder.cli.drain import drain_command
from builder.cli.check import check_command
from builder.cli.query import query_command
from builder.cli.repository import repository_command
from builder.cli.serve import serve_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="forge")
def main() -> None:
    """llm-forge: build an LLM engine and a Triton model repository from one spec, then serve it."""


for command in (engine_command, generate_command, bench_command, check_command,
                repository_command, serve_command, query_command, drain_command, deploy_command,
                gpu_check_command):
    main.add_command(command)


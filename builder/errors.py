"""Mapping errors to `forge` exit codes: 2 bad input, 3 quality gate, 1 anything else."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import click

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_QUALITY_GATE = 3


class QualityGateError(Exception):
    """A quantized engine crossed a quality threshold; the message names metric and threshold."""


@contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except QualityGateError as exc:
        click.echo(f"error: quality gate failed: {exc}", err=True)
        sys.exit(EXIT_QUALITY_GATE)
    except (ValueError, FileNotFoundError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)

"""Mapping errors to `forge` exit codes: 2 bad input, 3 quality gate, 1 anything else."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn

import click

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_QUALITY_GATE = 3


class QualityGateError(Exception):
    """A quantized engine crossed a quality threshold; the message names metric and threshold."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """End `forge` with `error: message` on stderr and the exit code."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except QualityGateError as exc:
        fail(f"quality gate failed: {exc}", EXIT_QUALITY_GATE)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))

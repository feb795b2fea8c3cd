"""What the `forge bench` subcommands share on the command line: the output directory, repeats,
the busy neighbour, list and NAME=DIR parsing (ValueErrors naming the option: `forge`'s bad
input, exit 2), and the threads and OpenMP spin of the engine process for in-process runs."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import click

CONDITIONS = ("quiet", "busy")


def out_option(default: str) -> Callable:
    return click.option("--out", "out_dir", type=click.Path(file_okay=False), default=default,
                        show_default=True, help="Directory of results.json and summary.md.")


def repeats_option(default: int) -> Callable:
    return click.option("--repeats", type=click.IntRange(min=1), default=default,
                        show_default=True, help="Runs of every case, in turns; tables show "
                        "medians, ratios also repeat by repeat.")


def threads_option(function: Callable) -> Callable:
    return click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
                        help="torch threads (0: the engine process's, its CPU budget).")(function)


neighbour_option = click.option(
    "--neighbour", default="quiet", show_default=True,
    help="quiet, busy or quiet,busy: every case alone and/or beside a busy loop pinned to one "
         "core (a server process wanting CPU), back to back.")


def conditions(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or not set(values) <= set(CONDITIONS) or len(set(values)) != len(values):
        raise ValueError(f"--neighbour must be quiet, busy or quiet,busy, got {text!r}")
    return values


def int_list(text: str, option: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{option} values must be >= {minimum}, got {text!r}")
    return values


def named_dirs(values: tuple[str, ...], option: str) -> dict[str, str]:
    """NAME=DIR, repeatable, each DIR an existing directory."""
    named = {}
    for value in values:
        name, _, path = value.partition("=")
        if not name or not path or not Path(path).is_dir():
            raise ValueError(f"{option} {value!r}: expected NAME=DIR with an existing DIR")
        if name in named:
            raise ValueError(f"{option}: {name!r} given twice")
        named[name] = path
    return named


def engine_process_like(threads: int) -> None:
    """Run in-process as the engine process runs: its OpenMP spin (set before torch loads) and
    its thread count (`threads`, or the CPU budget)."""
    from triton_backend.engine.process.handle import ENGINE_SPIN_COUNT, SPIN_ENV

    os.environ.setdefault(SPIN_ENV, ENGINE_SPIN_COUNT)
    import torch

    from triton_backend.engine.cpu_budget import cpu_budget

    torch.set_num_threads(threads or cpu_budget().threads)


def finish(doc: dict[str, Any], out_dir: str) -> None:
    from builder.bench.summary import finish as write_and_print

    write_and_print(doc, Path(out_dir))

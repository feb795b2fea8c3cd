"""The one output of every `forge bench` subcommand: `results.json` (tool, created, host,
settings, tables, notes, then the subcommand's own data: every request, run or repeat),
`summary.md` (the same tables in Markdown) and the tables printed. Figures are quoted with the
CPU they ran on, so the host's CPU, its flags and its load go into every document."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS_FILE, SUMMARY_FILE = "results.json", "summary.md"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
             "amx_int8")


def host() -> dict[str, Any]:
    """This machine as a figure's caption needs it: CPU model and flags, vCPUs, load."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "vcpus": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags],
            "machine": platform.machine(), "python": platform.python_version(),
            "load_average": round(os.getloadavg()[0], 2)}


def busy_before(seconds: float = 3.0) -> float:
    """The share of the machine's CPU time other work used over `seconds` (nothing of ours runs
    then): a quiet machine shows ~0.0."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def cpu_line(info: dict[str, Any]) -> str:
    return (f"{info['cpu']}, {info['vcpus']} vCPUs, {' '.join(info['flags']) or 'no AVX2'}; "
            f"load average {info['load_average']}")


@dataclass
class Table:
    """Formatted cells under column names; the first column names the row."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    title: str = ""

    def add(self, *cells: object) -> None:
        self.rows.append([str(cell) for cell in cells])

    def markdown(self) -> str:
        lines = [f"{self.title}\n"] if self.title else []
        lines += ["| " + " | ".join(self.columns) + " |",
                  "|---|" + "---:|" * (len(self.columns) - 1)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def rich(self) -> Any:
        from rich.table import Table as RichTable

        table = RichTable(title=self.title or None)
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        return table


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_cell(values: list[float], bases: list[float]) -> str:
    """`values` over `bases`: by the medians, then repeat by repeat (the two halves of a pair ran
    back to back, so a host that slows down between repeats moves both alike)."""
    pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(values, bases))
    return f"{median(values) / median(bases):.2f}x ({pairs})"


def document(tool: str, settings: dict[str, Any], tables: list[Table], notes: list[str] = (),
             **data: Any) -> dict[str, Any]:
    return {"tool": tool, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": host(), "settings": settings, "tables": [asdict(t) for t in tables],
            "notes": list(notes), **data}


def markdown(doc: dict[str, Any]) -> str:
    parts = [f"`{doc['tool']}` on {cpu_line(doc['host'])}; {doc['created']}\n"]
    parts += [Table(**table).markdown() for table in doc["tables"]]
    return "\n".join(parts + ["\n".join(doc["notes"]) + "\n" if doc["notes"] else ""])


def write(doc: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / SUMMARY_FILE).write_text(markdown(doc))
    return out / RESULTS_FILE


def finish(doc: dict[str, Any], out: Path, console: Any = None) -> Path:
    """Write `results.json` and `summary.md` into `out`, print the tables and notes."""
    from rich.console import Console

    console = console or Console(width=200)
    path = write(doc, out)
    console.print(f"{doc['tool']}: {cpu_line(doc['host'])}")
    for table in doc["tables"]:
        console.print(Table(**table).rich())
    for note in doc["notes"]:
        console.print(note, highlight=False)
    console.print(f"results: {path}")
    return path

"""The human side of a result: `results.json`, the printed tables, and the plots beside them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_FILE = "results.json"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def server_counters(level: dict[str, Any]) -> str:
    """The server's own view of a level: prefix cache hit rate, draft acceptance, mean accepted
    length (tokens per verify step)."""
    server = level.get("server") or {}
    return (f"{_pct(server.get('prefix_cache_hit_rate'))} / "
            f"{_pct(server.get('spec_acceptance_rate'))} / "
            f"{_num(server.get('spec_mean_accepted_length'), '{:.2f}')}")


def level_table(target: dict[str, Any]) -> Table:
    """One row per concurrency level of one target; latencies in ms, as p50 / p90 / p99."""
    table = Table(title=f"{target['label']}: {target['model']} @ {target['url']} ({target['protocol']})")
    scraped = any("server" in lv for lv in target["levels"])
    for header in ("conc", "ok/err/canc", "out tok/s", "req/s", "TTFT ms p50/p90/p99",
                   "ITL ms p50/p99", "E2E ms p50/p99") + (
                       ("hit rate / accept / tok per verify",) if scraped else ()):
        table.add_column(header, justify="right")
    for lv in target["levels"]:
        ttft, itl, e2e = lv["ttft_s"], lv["itl_s"], lv["e2e_s"]
        table.add_row(str(lv["concurrency"]),
                      f"{lv['completed']}/{lv['errors']}/{lv['cancelled']}",
                      _num(lv["output_tokens_per_s"]), _num(lv["requests_per_s"], "{:.2f}"),
                      f"{_ms(ttft['p50'])}/{_ms(ttft['p90'])}/{_ms(ttft['p99'])}",
                      f"{_ms(itl['p50'])}/{_ms(itl['p99'])}", f"{_ms(e2e['p50'])}/{_ms(e2e['p99'])}",
                      *((server_counters(lv),) if scraped else ()))
    return table


def comparison_table(result: dict[str, Any]) -> Table:
    """A vs B per concurrency: throughput ratio (A/B, >1 = A faster), TTFT p50 / p99 of each and
    the TTFT p50 ratio (< 1 = A faster), ITL p50 of each."""
    a, b = result["targets"]
    table = Table(title=f"{a['label']} vs {b['label']} (ratios are {a['label']}/{b['label']})")
    for header in ("conc", f"{a['label']} tok/s", f"{b['label']} tok/s", "tok/s ratio",
                   f"{a['label']} TTFT p50/p99 ms", f"{b['label']} TTFT p50/p99 ms",
                   "TTFT p50 ratio", f"{a['label']} ITL p50 ms", f"{b['label']} ITL p50 ms"):
        table.add_column(header, justify="right")
    for row, la, lb in zip(result["comparison"], a["levels"], b["levels"]):
        table.add_row(str(row["concurrency"]), _num(la["output_tokens_per_s"]),
                      _num(lb["output_tokens_per_s"]), _num(row["output_tokens_per_s_ratio"], "{:.2f}x"),
                      f"{_ms(la['ttft_s']['p50'])}/{_ms(la['ttft_s']['p99'])}",
                      f"{_ms(lb['ttft_s']['p50'])}/{_ms(lb['ttft_s']['p99'])}",
                      _num(row.get("ttft_p50_ratio"), "{:.2f}x"),
                      _ms(la["itl_s"]["p50"]), _ms(lb["itl_s"]["p50"]))
    return table


def print_report(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    wl = result["workload"]
    console.print(f"workload [bold]{wl['name']}[/] seed={wl['seed']} scale={wl['scale']} "
                  f"input tokens={wl['input_tokens']} max_tokens={wl['max_tokens']} "
                  f"stream={wl['stream']} fixed output={result['settings']['fixed_output']}")
    for target in result["targets"]:
        console.print(level_table(target))
        errors = sorted({e for lv in target["levels"] for e in lv["first_errors"]})
        if errors:
            console.print(f"[red]{target['label']} errors (first few):[/] " + "; ".join(errors[:3]))
        if result["settings"]["fixed_output"] and not target["fixed_output_honoured"]:
            console.print(f"[yellow]{target['label']}: model has no min_tokens input; output "
                          "lengths are not fixed[/]")
    if "comparison" in result:
        console.print(comparison_table(result))


def write_results(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def markdown_comparison(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table (for notes and docs)."""
    a, b = result["targets"]
    wl, settings = result["workload"], result["settings"]
    header = (f"Workload `{wl['name']}` (seed {wl['seed']}, scale {wl['scale']}; input tokens "
              f"{wl['input_tokens']}, max_tokens {wl['max_tokens']}), fixed output length "
              f"{settings['fixed_output']}, requests per level {settings.get('requests')}, "
              f"measured {result.get('created', '?')}. Ratio = {a['label']}/{b['label']} "
              "output tokens/s.\n\n")
    lines = [f"| concurrency | {a['label']} out tok/s | {b['label']} out tok/s | ratio | "
             f"{a['label']} TTFT p50 / p99 ms | {b['label']} TTFT p50 / p99 ms | "
             f"{a['label']} ITL p50 ms | {b['label']} ITL p50 ms | {a['label']} server: hit rate "
             f"/ accept / tok per verify |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, la, lb in zip(result["comparison"], a["levels"], b["levels"]):
        lines.append(f"| {row['concurrency']} | {_num(la['output_tokens_per_s'])} | "
                     f"{_num(lb['output_tokens_per_s'])} | "
                     f"{_num(row['output_tokens_per_s_ratio'], '{:.2f}x')} | "
                     f"{_ms(la['ttft_s']['p50'])} / {_ms(la['ttft_s']['p99'])} | "
                     f"{_ms(lb['ttft_s']['p50'])} / {_ms(lb['ttft_s']['p99'])} | "
                     f"{_ms(la['itl_s']['p50'])} | {_ms(lb['itl_s']['p50'])} | "
                     f"{server_counters(la)} |")
    return header + "\n".join(lines) + "\n"


def markdown_levels(result: dict[str, Any]) -> str:
    """Every target's levels as Markdown tables (summary.md of a run without a comparison)."""
    wl = result["workload"]
    parts = [f"Workload `{wl['name']}` (seed {wl['seed']}, scale {wl['scale']}; input tokens "
             f"{wl['input_tokens']}, max_tokens {wl['max_tokens']}), measured "
             f"{result.get('created', '?')}.\n"]
    for target in result["targets"]:
        lines = [f"{target['label']}: {target['model']} @ {target['url']} ({target['protocol']})",
                 "", "| concurrency | ok/err/canc | out tok/s | req/s | TTFT p50 / p90 / p99 ms | "
                 "ITL p50 / p99 ms | E2E p50 / p99 ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in target["levels"]:
            ttft, itl, e2e = lv["ttft_s"], lv["itl_s"], lv["e2e_s"]
            lines.append(f"| {lv['concurrency']} | {lv['completed']}/{lv['errors']}/"
                         f"{lv['cancelled']} | {_num(lv['output_tokens_per_s'])} | "
                         f"{_num(lv['requests_per_s'], '{:.2f}')} | {_ms(ttft['p50'])} / "
                         f"{_ms(ttft['p90'])} / {_ms(ttft['p99'])} | {_ms(itl['p50'])} / "
                         f"{_ms(itl['p99'])} | {_ms(e2e['p50'])} / {_ms(e2e['p99'])} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)

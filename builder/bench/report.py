"""The served level's tables (one per server, and A vs B), in `forge bench`'s one format
(`summary.Table`: printed, in `summary.md`, in `results.json`), and the plots beside them."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from builder.bench.summary import Table, ms, num, pct
from builder.bench.summary import write as write_document


def server_counters(level: dict[str, Any]) -> str:
    """The server's own view of a level: prefix cache hit rate, draft acceptance, mean accepted
    length (tokens per verify step)."""
    server = level.get("server") or {}
    return (f"{pct(server.get('prefix_cache_hit_rate'))} / "
            f"{pct(server.get('spec_acceptance_rate'))} / "
            f"{num(server.get('spec_mean_accepted_length'), '{:.2f}')}")


def level_table(target: dict[str, Any]) -> Table:
    """One row per concurrency level of one target; latencies in ms, as p50 / p90 / p99."""
    scraped = any("server" in lv for lv in target["levels"])
    table = Table(["concurrency", "ok/err/canc", "out tok/s", "req/s", "TTFT ms p50/p90/p99",
                   "ITL ms p50/p99", "E2E ms p50/p99"]
                  + (["server: hit rate / accept / tok per verify"] if scraped else []),
                  title=f"{target['label']}: {target['model']} @ {target['url']} "
                        f"({target['protocol']})")
    for lv in target["levels"]:
        ttft, itl, e2e = lv["ttft_s"], lv["itl_s"], lv["e2e_s"]
        table.add(lv["concurrency"], f"{lv['completed']}/{lv['errors']}/{lv['cancelled']}",
                  num(lv["output_tokens_per_s"]), num(lv["requests_per_s"], "{:.2f}"),
                  f"{ms(ttft['p50'])}/{ms(ttft['p90'])}/{ms(ttft['p99'])}",
                  f"{ms(itl['p50'])}/{ms(itl['p99'])}", f"{ms(e2e['p50'])}/{ms(e2e['p99'])}",
                  *([server_counters(lv)] if scraped else []))
    return table


def comparison_table(result: dict[str, Any]) -> Table:
    """A vs B per concurrency: throughput ratio (A/B, >1 = A faster), TTFT p50 / p99 of each and
    the TTFT p50 ratio (< 1 = A faster), ITL p50 of each, A's server counters."""
    a, b = result["targets"]
    la_, lb_ = a["label"], b["label"]
    table = Table(["concurrency", f"{la_} out tok/s", f"{lb_} out tok/s", "ratio",
                   f"{la_} TTFT p50 / p99 ms", f"{lb_} TTFT p50 / p99 ms", "TTFT p50 ratio",
                   f"{la_} ITL p50 ms", f"{lb_} ITL p50 ms",
                   f"{la_} server: hit rate / accept / tok per verify"],
                  title=f"{la_} vs {lb_} (ratios are {la_}/{lb_})")
    for row, la, lb in zip(result["comparison"], a["levels"], b["levels"]):
        table.add(row["concurrency"], num(la["output_tokens_per_s"]),
                  num(lb["output_tokens_per_s"]), num(row["output_tokens_per_s_ratio"], "{:.2f}x"),
                  f"{ms(la['ttft_s']['p50'])} / {ms(la['ttft_s']['p99'])}",
                  f"{ms(lb['ttft_s']['p50'])} / {ms(lb['ttft_s']['p99'])}",
                  num(row.get("ttft_p50_ratio"), "{:.2f}x"), ms(la["itl_s"]["p50"]),
                  ms(lb["itl_s"]["p50"]), server_counters(la))
    return table


def token_range(summary: dict | None) -> str:
    """A workload's token range (`Workload.describe`) in words; None: prompts were not tokenized."""
    if summary is None:
        return "not counted (no tokenizer: --engine DIR or --tokenizer DIR counts them)"
    if summary["min"] == summary["max"]:
        return str(summary["min"])
    return f"{summary['min']}-{summary['max']} (mean {summary['mean']:g})"


def workload_line(result: dict[str, Any]) -> str:
    wl, settings = result["workload"], result["settings"]
    return (f"workload {wl['name']} (seed {wl['seed']}, scale {wl['scale']}; input tokens "
            f"{token_range(wl['input_tokens'])}; max_tokens {token_range(wl['max_tokens'])}; "
            f"stream {wl['stream']}), fixed output {settings['fixed_output']}, requests per "
            f"level {settings.get('requests')}")


def refresh(result: dict[str, Any]) -> dict[str, Any]:
    """Set the document's tables and notes from its levels (after every level)."""
    tables = [level_table(t) for t in result["targets"]]
    if "comparison" in result:
        tables.append(comparison_table(result))
    notes = [workload_line(result)]
    for target in result["targets"]:
        errors = sorted({e for lv in target["levels"] for e in lv["first_errors"]})
        if errors:
            notes.append(f"{target['label']} errors (first few): " + "; ".join(errors[:3]))
        if result["settings"]["fixed_output"] and not target["fixed_output_honoured"]:
            notes.append(f"{target['label']}: model has no min_tokens input; output lengths "
                         "are not fixed")
    result["tables"], result["notes"] = [asdict(t) for t in tables], notes
    return result


def write_results(result: dict[str, Any], out_dir: Path) -> Path:
    return write_document(refresh(result), out_dir)

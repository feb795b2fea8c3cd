"""The one table `forge gpu-check` prints: per shape and concurrency the engine beside
transformers and the roofline, then every check with its target."""
from __future__ import annotations

from rich.table import Table


def speed_table(report: dict) -> Table:
    table = Table(title=f"gpu-check on {report['machine'].get('gpu') or report['machine']['cpu']} "
                        f"({report['device']}, prompts {report['prompt_len']}, "
                        f"{report['new_tokens']} new tokens)")
    for header in ("shape", "c", "engine tok/s", "transformers tok/s", "x transformers",
                   "decode step ms", "roofline c=1 tok/s"):
        table.add_column(header, justify="right")
    for name, shape in report["shapes"].items():
        for row in shape["speed"]:
            table.add_row(name, str(row["concurrency"]), f"{row['tok_s']:.1f}",
                          f"{row['transformers_tok_s']:.1f}", f"{row['ratio']:.2f}",
                          f"{row['decode_step_ms']:.2f}", f"{shape['roofline_c1_tok_s']:.0f}")
    return table


def checks_table(report: dict) -> Table:
    table = Table(title="checks" + ("" if report["passed"] else " (FAILED)"))
    for header in ("check", "value", "target", "result"):
        table.add_column(header)
    for check in report["checks"]:
        result = ("pass" if check["passed"] else "FAIL") if check["applied"] else "reported"
        table.add_row(check["name"], str(check["value"]), check["target"], result)
    return table


def ledger_table(report: dict) -> Table:
    """Each check's status, time against its budget, and what it cost in counts."""
    totals = report.get("totals", {})
    table = Table(title=f"time per check ({totals.get('seconds', 0):.1f} s in all)")
    for header in ("check", "status", "seconds", "budget s", "triton variants", "captures",
                   "builds", "loads", "reference runs"):
        table.add_column(header, justify="left" if header in ("check", "status") else "right")
    for record in report.get("ledger", []):
        c = record["counts"]
        table.add_row(record["name"], record["status"], f"{record['seconds']:.1f}",
                      f"{record['budget_s']:.0f}", str(c["kernel_variants"]),
                      str(c["graph_captures"]), str(c["engine_builds"]), str(c["engine_loads"]),
                      str(c["reference_runs"]))
    table.add_row("all", "", f"{totals.get('seconds', 0):.1f}", "",
                  str(totals.get("kernel_variants", 0)), str(totals.get("graph_captures", 0)),
                  str(totals.get("engine_builds", 0)), str(totals.get("engine_loads", 0)),
                  str(totals.get("reference_runs", 0)))
    return table


def estimate_lines(report: dict) -> list[str]:
    estimate = report.get("cold_gpu_estimate")
    if not estimate:
        return []
    terms = ", ".join(f"{name} {seconds:g} s" for name, seconds in estimate["terms"].items())
    verdict = "fits" if estimate["fits_5_minutes"] else "does NOT fit"
    plan, here = estimate["gpu_plan"], estimate["this_run"]
    match = ("equal this run's plan" if here["counts_match"]
             else f"differ from this run's plan {here['planned']}")
    return [f"cold GPU run estimated at {estimate['seconds']:g} s ({verdict} 5 minutes): {terms}",
            f"  the GPU plan: {plan['engine_builds']} engine builds, {plan['engine_loads']} loads, "
            f"{plan['graph_captures']} graph captures (batch sizes {plan['capture_sizes']}), "
            f"{plan['kernel_variants']} Triton compiles, {plan['reference_runs']} reference runs",
            f"  counted here: {here['measured']} ({match}; Triton compiles seen: "
            f"{report['totals'].get('triton_compiles', 0)})"]

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

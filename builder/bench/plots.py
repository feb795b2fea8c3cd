"""PNG plots of a result: throughput vs concurrency, TTFT p99 vs throughput, ITL vs concurrency."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _series(target: dict[str, Any], key: str, stat: str | None = None) -> list[float | None]:
    values = [lv[key] if stat is None else lv[key][stat] for lv in target["levels"]]
    return values


def _log_scale_if_wide(ax: Any, label: str) -> None:
    """Servers can differ by orders of magnitude; a linear axis would flatten the faster one."""
    values = [y for line in ax.get_lines() for y in line.get_ydata() if y == y and y > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
        ax.set_ylabel(label)


def _finish(fig: Any, ax: Any, title: str, path: Path) -> None:
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=0)  # ratios between servers read honestly only from a zero baseline
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the plots into `out_dir`; returns their paths. Uses the non-interactive Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install matplotlib (or use --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    workload = result["workload"]["name"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in result["targets"]:
        conc = _series(target, "concurrency")
        ax.plot(conc, _series(target, "output_tokens_per_s"), marker="o", label=target["label"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["settings"]["concurrencies"], [str(c) for c in result["settings"]["concurrencies"]])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tokens/s)")
    paths.append(out_dir / "throughput_vs_concurrency.png")
    _finish(fig, ax, f"Output throughput vs concurrency ({workload})", paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in result["targets"]:
        tps = _series(target, "output_tokens_per_s")
        ttft = [None if v is None else v * 1000 for v in _series(target, "ttft_s", "p99")]
        points = [(x, y, c) for x, y, c in zip(tps, ttft, _series(target, "concurrency")) if y is not None]
        line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=target["label"])
        for x, y, c in points:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8, color=line.get_color())
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("TTFT p99 (ms)")
    _log_scale_if_wide(ax, "TTFT p99 (ms, log scale)")
    paths.append(out_dir / "ttft_p99_vs_throughput.png")
    _finish(fig, ax, f"TTFT p99 vs throughput ({workload}; lower right is better)", paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in result["targets"]:
        conc = _series(target, "concurrency")
        color = None  # one colour per server: p50 solid, p99 dashed
        for stat, style in (("p50", "-"), ("p99", "--")):
            itl = [None if v is None else v * 1000 for v in _series(target, "itl_s", stat)]
            line, = ax.plot(conc, [float("nan") if v is None else v for v in itl], style,
                            marker="o", color=color, label=f"{target['label']} {stat}")
            color = line.get_color()
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["settings"]["concurrencies"], [str(c) for c in result["settings"]["concurrencies"]])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("inter-token latency (ms)")
    _log_scale_if_wide(ax, "inter-token latency (ms, log scale)")
    paths.append(out_dir / "itl_vs_concurrency.png")
    _finish(fig, ax, f"Inter-token latency vs concurrency ({workload})", paths[-1])
    plt.close(fig)
    return paths

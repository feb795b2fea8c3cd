"""The OpenAI endpoint vs Triton's gRPC streaming on the same workload, same server, same run.

Builds the spec's engine and repository if missing, starts `forge serve --openai-port` on free
loopback ports, then runs `forge bench --compare OPENAI GRPC --protocol openai,grpc` `--repeats`
times (the order of the two paths flips every repeat, and `forge bench` flips it every level),
and prints the median tok/s and TTFT p50 per concurrency with the OpenAI/gRPC ratios. Every
repeat's report stays in --out/repeat-N. On a busy machine the figures are noisy: re-measure on
a quiet one before quoting them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compare import ensure_engine, forge_command  # noqa: E402


def _log(message: str) -> None:
    print(f"[bench-openai] {message}", flush=True)


def start_forge_serve(repository: Path, log_path: Path) -> tuple[subprocess.Popen, str, str]:
    """`forge serve --openai-port` on free ports; returns (process, openai host:port, gRPC)."""
    from builder.serving.serve import free_port

    http, grpc, metrics, openai = (free_port() for _ in range(4))
    log = open(log_path, "wb")
    process = subprocess.Popen(
        forge_command() + ["serve", "--repository", str(repository), "--http-port", str(http),
                           "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                           "--openai-port", str(openai), "--health-port", "0"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    openai_url, deadline = f"127.0.0.1:{openai}", time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"forge serve exited; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://{openai_url}/v1/models", timeout=2):
                return process, openai_url, f"127.0.0.1:{grpc}"
        except OSError:
            if time.monotonic() > deadline:
                process.terminate()
                raise TimeoutError(f"forge serve not ready after 600s; see {log_path}")
            time.sleep(0.5)


def level_figures(results: Path) -> dict[int, dict[str, tuple[float, float]]]:
    """{concurrency: {label: (output tok/s, TTFT p50 s)}} of one report, over all its levels."""
    figures: dict[int, dict[str, tuple[float, float]]] = {}
    for target in json.loads(results.read_text())["targets"]:
        for level in target["levels"]:
            figures.setdefault(level["concurrency"], {})[target["label"]] = (
                level["output_tokens_per_s"], level["ttft_s"]["p50"])
    return figures


def summarize(repeats: list[dict]) -> list[dict]:
    rows = []
    for concurrency in sorted(repeats[0]):
        runs = [r[concurrency] for r in repeats if concurrency in r]
        row = {"concurrency": concurrency, "repeats": len(runs)}
        for label in ("openai", "grpc"):
            row[f"{label}_tok_s"] = statistics.median(r[label][0] for r in runs)
            row[f"{label}_ttft_p50_ms"] = 1000 * statistics.median(r[label][1] for r in runs)
        row["tok_s_ratio"] = statistics.median(r["openai"][0] / r["grpc"][0] for r in runs)
        row["ttft_p50_ratio"] = statistics.median(r["openai"][1] / r["grpc"][1] for r in runs)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | openai tok/s | grpc tok/s | tok/s ratio (>= 0.9) | openai TTFT p50 ms "
             "| grpc TTFT p50 ms | TTFT p50 ratio (<= 1.2) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['openai_tok_s']:.1f} | {r['grpc_tok_s']:.1f} | "
                     f"{r['tok_s_ratio']:.3f} | {r['openai_ttft_p50_ms']:.1f} | "
                     f"{r['grpc_ttft_p50_ms']:.1f} | {r['ttft_p50_ratio']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "smollm2-135m.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "openai")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--scale", default="0.25", help="token-length scale of the workload")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", default="4x", help="per level: N, or Kx = K x concurrency")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    engine, repository = ensure_engine(args.spec.resolve(), rebuild=False)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    process, openai_url, grpc_url = start_forge_serve(repository, args.out / "forge-serve.log")
    repeats = []
    try:
        _log(f"OpenAI endpoint {openai_url}, gRPC {grpc_url}")
        for n in range(args.repeats):
            pairs = [("openai", openai_url), ("grpc", grpc_url)]
            pairs = pairs if n % 2 == 0 else pairs[::-1]
            out = args.out / f"repeat-{n}"
            bench = ["bench", "--compare", pairs[0][1], pairs[1][1],
                     "--protocol", ",".join(p for p, _ in pairs),
                     "--labels", ",".join(p for p, _ in pairs), "--workload", args.workload,
                     "--scale", args.scale, "--concurrency", args.concurrency,
                     "--requests", args.requests, "--tokenizer", str(engine),
                     "--out", str(out), "--no-plots"]
            _log(f"repeat {n + 1}/{args.repeats}: forge " + " ".join(bench))
            if subprocess.call(forge_command() + bench, cwd=ROOT) != 0:
                return 1
            repeats.append(level_figures(out / "results.json"))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    rows = summarize(repeats)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "summary.md").write_text(table(rows) + "\n")
    print(f"\nmedians over {args.repeats} repeats ({args.workload}, scale {args.scale}):")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

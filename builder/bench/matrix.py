"""`forge bench matrix`: `forge serve` (and, `--against vllm`, `vllm serve`) through the front
door, measured by vLLM's own client on a matrix of shapes (`shapes.py`).

Each server is started alone on loopback, driven through every shape by `vllm bench serve
--backend openai` (/v1/completions, streamed; lengths forced with `--ignore-eos`, and
`min_tokens` = OUT when they are fixed; `--temperature` sent with every request, greedy by
default, so both servers do the same work: left out, vLLM samples at its checkpoint's defaults
and we decode greedily), and stopped before the next one starts; with repeats
the servers alternate order and the table shows medians. Goodput is the client's `--goodput`:
requests per second with TTFT <= slo_ttft_ms + slo_ttft_ms_per_token x IN and TPOT <=
slo_tpot_ms. Both servers serve the checkpoint the repository's engine was built from, in bf16,
under the engine's name; the client counts tokens with that checkpoint's tokenizer. Ratios are
to vLLM, or without it to the first repository (then without the goodput issue's checks)."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from builder.bench.servers import LOOPBACK, ServerProcess, clean_env, forge_command, tail, vllm_env
from builder.bench.shapes import Shape
from builder.bench.summary import Table, busy_before, document
from builder.serving.serve import free_port

# (key in vLLM's result JSON, column name)
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_itl_ms", "ITL p50 ms"),
           ("p99_itl_ms", "ITL p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
           ("request_goodput", "goodput req/s"))


@dataclass
class Matrix:
    """A run: the forge repositories by label (the first is the reference), the shapes, the
    client's settings, and what the first repository's engine says of the model."""

    vllm_venv: str
    repositories: dict[str, str]
    shapes: list[Shape]
    against_vllm: bool = False
    checkpoint: str = ""
    model_name: str = ""
    max_model_len: int = 4096
    warmups: int = 2
    repeats: int = 1
    seed: int = 0
    temperature: float = 0.0
    slo_ttft_ms: float = 2000.0
    slo_ttft_ms_per_token: float = 4.0
    slo_tpot_ms: float = 200.0
    vllm_kv_gib: int = 2
    ready_timeout: float = 600.0
    client_timeout: float = 1800.0
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def labels(self) -> list[str]:
        return (["vllm"] if self.against_vllm else []) + list(self.repositories)

    def slo_ttft(self, shape: Shape) -> float:
        return self.slo_ttft_ms + self.slo_ttft_ms_per_token * shape.input_len


def resolve(matrix: Matrix, checkpoint: str | None) -> None:
    """The model of the first repository: its name, limits and checkpoint (the builder's own
    resolution), and whether the checkpoint's files hash as the engine's manifest says."""
    from builder.pipeline.checkpoint import resolve_checkpoint, sha256_file
    from builder.repository.target import served_engine

    names = {}
    for label, repository in matrix.repositories.items():
        engine = served_engine(Path(repository))
        if engine is None or not (engine / "config.json").is_file():
            raise ValueError(f"{label}: {repository} serves no engine built here (build it with "
                             f"`forge engine --spec ...`)")
        names[label] = (engine, json.loads((engine / "config.json").read_text()))
    engine, config = next(iter(names.values()))
    if any(c["name"] != config["name"] for _, c in names.values()):
        raise ValueError(f"--forge: every repository must serve {config['name']!r}")
    manifest = json.loads((engine / "manifest.json").read_text())
    path = resolve_checkpoint(checkpoint or manifest["spec"]["checkpoint"], log=lambda m: None)
    expected = manifest.get("checkpoint_files") or {}
    same = bool(expected) and all((path / n).is_file() and sha256_file(path / n) == digest
                                  for n, digest in expected.items())
    matrix.checkpoint, matrix.model_name = str(path), config["name"]
    matrix.max_model_len = int(config.get("limits", {}).get("max_seq_len", 4096))
    matrix.facts.update(engine=str(engine), checkpoint_matches_engine_manifest=same)


def client_command(matrix: Matrix, port: int, shape: Shape, result: Path) -> list[str]:
    command = [str(Path(matrix.vllm_venv) / "bin" / "vllm"), "bench", "serve",
               "--backend", "openai", "--base-url", f"http://{LOOPBACK}:{port}",
               "--endpoint", "/v1/completions", "--model", matrix.model_name,
               "--tokenizer", matrix.checkpoint, "--dataset-name", "random",
               "--random-input-len", str(shape.input_len),
               "--random-output-len", str(shape.output_len),
               "--random-range-ratio", f"{shape.range_ratio:g}",
               "--num-prompts", str(shape.prompts), "--max-concurrency", str(shape.concurrency),
               "--request-rate", "inf", "--num-warmups", str(matrix.warmups),
               "--seed", str(matrix.seed), "--temperature", f"{matrix.temperature:g}",
               "--ignore-eos",
               "--goodput", f"ttft:{matrix.slo_ttft(shape):g}", f"tpot:{matrix.slo_tpot_ms:g}",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--disable-tqdm", "--save-result", "--save-detailed",
               "--result-dir", str(result.parent.resolve()), "--result-filename", result.name]
    if not shape.range_ratio:  # fixed lengths: min_tokens too
        command += ["--extra-body", json.dumps({"min_tokens": shape.output_len})]
    return command


def run_shape(matrix: Matrix, port: int, shape: Shape, run_dir: Path, label: str) -> dict:
    result, client_log = (run_dir / f"{label}-{shape.key}{ext}" for ext in (".json", ".client.log"))
    result.unlink(missing_ok=True)
    command = client_command(matrix, port, shape, result)
    level: dict[str, Any] = {"shape": asdict(shape), "client_command": command,
                             "result_file": str(result), "client_log": str(client_log)}
    with client_log.open("wb") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=clean_env(),
                                  timeout=matrix.client_timeout)
        except subprocess.TimeoutExpired:
            level["error"] = f"vllm bench serve did not finish within {matrix.client_timeout:g} s"
            return level
    if done.returncode != 0 or not result.is_file():
        level["error"] = (f"vllm bench serve exited with {done.returncode}; tail of "
                          f"{client_log}:\n{tail(client_log, 2500)}")
        return level
    raw = json.loads(result.read_text())
    lengths = sorted(set(raw.get("output_lens") or []))
    level.update(raw=raw, figures={key: float(raw.get(key) or 0.0) for key, _ in METRICS},
                 completed=raw.get("completed"), output_lens=lengths)
    if raw.get("completed") != shape.prompts:
        errors = sorted({e for e in raw.get("errors") or [] if e})
        level["error"] = (f"{raw.get('completed')} of {shape.prompts} requests completed; "
                          f"errors the client saw: {errors or 'none recorded'}")
    if not shape.range_ratio and lengths and lengths != [shape.output_len]:
        level["warning"] = (f"output lengths {lengths}, not all {shape.output_len}: "
                            f"ignore_eos / min_tokens was not honoured")
    return level


def threads_of(label: str, log_path: Path) -> str:
    """The cores a server computes on, as its log says (vLLM reserves some for its front end by
    default; forge serve prints its engine's torch threads)."""
    found = []
    for line in tail(log_path, 200_000).splitlines():
        if label == "vllm" and ("core ids=" in line or "reserved_cpus=" in line):
            found.append(line.split("]", 1)[-1].replace("local_rank=0, ", "").strip())
        elif label != "vllm" and line.startswith("engine: ") and "threads" in line:
            found.append(line[len("engine: "):].split(" (")[0])
    found = list(dict.fromkeys(item.strip() for item in found))
    return ("engine on " if label == "vllm" and found else "") + ("; ".join(found) or "not reported")


def probe(port: int, model: str, temperature: float) -> dict:
    """One streamed completion shaped as the client's (its fields, plus the extra body), to see
    a refusal in full: the client itself keeps only the HTTP reason."""
    payload = {"model": model, "prompt": "An inference server is", "repetition_penalty": 1.0,
               "temperature": temperature,
               "max_tokens": 4, "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4}
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/completions",
                                     json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = reply.read().decode(errors="replace")
            return {"status": reply.status, "ok": "[DONE]" in body, "body": body[-600:]}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "ok": False, "body": error.read().decode(errors="replace")}
    except OSError as error:
        return {"status": None, "ok": False, "body": repr(error)}


def one_server(matrix: Matrix, label: str, run_dir: Path, log: Any) -> dict:
    port, log_path = free_port(), run_dir / f"{label}.log"
    if label == "vllm":
        command = [str(Path(matrix.vllm_venv) / "bin" / "vllm"), "serve", matrix.checkpoint,
                   "--host", LOOPBACK, "--port", str(port), "--dtype", "bfloat16",
                   "--served-model-name", matrix.model_name,
                   "--max-model-len", str(matrix.max_model_len)]
        env, stop_signal = vllm_env(matrix.vllm_kv_gib), signal.SIGINT
    else:  # Triton's own ports and the health port: 0 lets forge serve pick free ones
        command = forge_command() + ["serve", "--repository", matrix.repositories[label],
                                     "--http-port", "0", "--grpc-port", "0", "--metrics-port",
                                     "0", "--health-port", "0", "--openai-port", str(port)]
        env, stop_signal = clean_env(), signal.SIGTERM
    record: dict[str, Any] = {"server_command": command, "log": str(log_path),
                              "busy_before": busy_before(), "levels": {}}
    log(f"starting {label} on {LOOPBACK}:{port} (CPU busy with other work just before: "
        f"{record['busy_before']:.0%})")
    with ServerProcess(command, log_path, env, stop_signal, port) as server:
        try:
            record["ready_s"] = server.wait_ready(matrix.ready_timeout)
            record["threads"] = threads_of(label, log_path)
            record["probe"] = probe(port, matrix.model_name, matrix.temperature)
            log(f"  {label} ready after {record['ready_s']:.0f} s ({record['threads']}); probe: "
                f"HTTP {record['probe']['status']}" + ("" if record["probe"]["ok"] else
                                                        f" {record['probe']['body'][:500]}"))
            for shape in matrix.shapes:
                level = record["levels"][shape.label] = run_shape(matrix, port, shape, run_dir,
                                                                  label)
                if "figures" in level:
                    log(f"  {label} {shape.label}: " + ", ".join(
                        f"{name} {level['figures'][key]:.1f}" for key, name in METRICS))
                for key in ("warning", "error"):
                    if key in level:
                        log(f"  {label} {shape.label} {key}: {level[key]}")
        except (RuntimeError, TimeoutError, OSError) as error:
            record["error"] = str(error)
            log(f"  {label}: {error}")
    return record


def medians(runs: list[dict], label: str, shape: Shape) -> dict | None:
    levels = [run[label]["levels"].get(shape.label, {}) for run in runs]
    if not levels or any("figures" not in level or "error" in level for level in levels):
        return None
    return {key: statistics.median(level["figures"][key] for level in levels) for key, _ in METRICS}


def verdicts(figures: dict, vllm: dict) -> list[str]:
    """What the long-prompt issue asks of forge on one shape against `vllm serve`, each either
    met or not (its ITL rule is vLLM's own p99, which replaced "p99 <= 4x our p50")."""
    checks = [("tok/s >= 1.2x", figures["output_throughput"] >= 1.2 * vllm["output_throughput"]),
              ("TTFT p50 <=", figures["median_ttft_ms"] <= vllm["median_ttft_ms"]),
              ("goodput >=", figures["request_goodput"] >= vllm["request_goodput"]),
              ("ITL p99 <=", figures["p99_itl_ms"] <= vllm["p99_itl_ms"])]
    return [f"{name} {'yes' if ok else 'NO'}" for name, ok in checks]


def build_table(matrix: Matrix, runs: list[dict]) -> tuple[Table, dict, dict]:
    """One row per shape and server, then the ratio rows to the first label (vLLM, or the first
    repository), with the issue's checks against vLLM only."""
    labels = matrix.labels
    base = labels[0]
    summary: dict = {label: {} for label in labels}
    ratios: dict = {label: {} for label in labels[1:]}
    table = Table(["shape", "server", *(name for _, name in METRICS), "checks"])
    for shape in matrix.shapes:
        for label in labels:
            figures = summary[label][shape.label] = medians(runs, label, shape)
            table.add(shape.label, label, *(["failed"] * len(METRICS) if figures is None else [
                f"{figures[key]:.2f}" if key == "request_goodput" else f"{figures[key]:.1f}"
                for key, _ in METRICS]), "")
        baseline = summary[base][shape.label]
        for label in labels[1:]:
            figures = summary[label][shape.label]
            both = figures is not None and baseline is not None
            ratio = ratios[label][shape.label] = ({
                key: figures[key] / baseline[key] if baseline[key] else None
                for key, _ in METRICS} if both else None)
            table.add(shape.label, f"**{label} / {base}**", *(
                ["-"] * len(METRICS) if ratio is None else
                ["-" if v is None else f"{v:.2f}x" for v in ratio.values()]),
                ", ".join(verdicts(figures, baseline)) if both and base == "vllm" else "")
    return table, summary, ratios


def run(matrix: Matrix, out: Path, log: Any = print) -> tuple[dict, bool]:
    """Every repeat, every server alone through every shape; the document, and whether every
    shape of every server gave figures."""
    version = subprocess.run([str(Path(matrix.vllm_venv) / "bin" / "python"), "-c",
                              "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, env=clean_env()).stdout.strip()
    log(f"model {matrix.model_name!r}: {matrix.facts['engine']}, checkpoint {matrix.checkpoint}; "
        f"vLLM {version or '?'} from {matrix.vllm_venv}")
    runs = []
    for repeat in range(matrix.repeats):
        run_dir = out / f"repeat-{repeat + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        order = matrix.labels[::-1 if repeat % 2 else 1]
        runs.append({label: one_server(matrix, label, run_dir, log) for label in order})
    table, summary, ratios = build_table(matrix, runs)
    labels = matrix.labels
    notes = [f"workload: vllm bench serve --backend openai, /v1/completions streamed, random "
             f"prompts, --ignore-eos (+ min_tokens for fixed lengths), {matrix.warmups} warm-ups"
             f"{f'; medians of {len(runs)} repeats' if len(runs) > 1 else ''}; goodput SLOs: TTFT "
             f"<= {matrix.slo_ttft_ms:g} ms + {matrix.slo_ttft_ms_per_token:g} ms per prompt "
             f"token, TPOT <= {matrix.slo_tpot_ms:g} ms; CPU busy with other work just before: "
             + ", ".join(f"{label} {max(r[label]['busy_before'] for r in runs):.0%}"
                         for label in labels),
             "threads: " + "; ".join(f"{label}: {runs[0][label].get('threads', '?')}"
                                     for label in labels),
             f"ratios to {labels[0]}: tok/s and goodput above 1 is better; TTFT / ITL / TPOT "
             "below 1 is faster"]
    settings = {k: v for k, v in asdict(matrix).items() if k not in ("facts", "shapes")}
    doc = document("forge bench matrix", {**settings, "shapes": [asdict(s) for s in matrix.shapes]},
                   [table], notes, **matrix.facts, vllm={"version": version, "environment": {
                       k: v for k, v in os.environ.items() if k.startswith("VLLM_")
                       or k == "LD_PRELOAD"}},
                   medians=summary, baseline=labels[0], ratios_to_baseline=ratios, runs=runs)
    failed = [f"{label} {shape}" for label in labels for shape, v in summary[label].items()
              if v is None]
    if failed:
        doc["notes"].append(f"failed: {', '.join(failed)} (the errors are under runs)")
    return doc, not failed

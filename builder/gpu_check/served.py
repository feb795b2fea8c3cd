"""The engine served: `forge serve` on the largest shape's repository (where `tritonserver`
can be found: on PATH, or in the nvidia-pytriton wheel), the OpenAI demo request, and a short
`forge bench` at the largest concurrency, set beside the in-process figure."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

DEMO_QUESTION = "What is the capital of France?"
MIN_SERVED_RATIO = 0.8  # served tok/s over in-process at the same concurrency, on a GPU
READY_LINE = "OpenAI API ready"


def tritonserver_available() -> bool:
    return bool(shutil.which("tritonserver")) or importlib.util.find_spec("pytriton") is not None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(repository: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "builder.cli", "serve", "--repository", str(repository),
               "--openai-port", str(port), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0", "--health-port", "0"]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ), start_new_session=True)


def _wait_ready(server: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if READY_LINE in log.read_text(errors="replace"):
            return
        if server.poll() is not None:
            raise RuntimeError(f"forge serve exited {server.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"forge serve not ready in {timeout:.0f}s")


def _demo_request(port: int, model: str) -> dict:
    body = json.dumps({"model": model, "max_tokens": 16,
                       "messages": [{"role": "user", "content": DEMO_QUESTION}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _bench(port: int, concurrency: int, prompt_len: int, new_tokens: int, work: Path,
           timeout: float | None) -> float:
    """Output tok/s of `forge bench` (OpenAI completions, every request max_tokens long)."""
    workload = work / "served-workload.jsonl"
    words = " ".join(DEMO_QUESTION.split()[i % 6] for i in range(prompt_len))
    workload.write_text("".join(json.dumps({"prompt": words, "max_tokens": new_tokens}) + "\n"
                                for _ in range(4 * concurrency)))
    out = work / "served-bench"
    command = [sys.executable, "-m", "builder.cli", "bench", "--url", f"127.0.0.1:{port}",
               "--protocol", "openai", "--workload", str(workload), "--concurrency",
               str(concurrency), "--requests", "3x", "--fixed-output", "--warmup", "2",
               "--out", str(out), "--no-plots"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"forge bench did not finish in the check's {timeout:.0f} s") from None
    if run.returncode != 0:
        raise RuntimeError(f"forge bench exited {run.returncode}:\n{run.stdout[-2000:]}"
                           f"{run.stderr[-2000:]}")
    result = json.loads((out / "results.json").read_text())
    return float(result["targets"][0]["levels"][0]["output_tokens_per_s"])


def check_served(engine_dir: Path, settings, report, say: Callable[[str], None],
                 remaining: Callable[[], float | None] = lambda: None) -> None:
    """`remaining`: seconds left to the check, which bound the waits for the server and bench."""
    if not tritonserver_available():
        report.extra["served"] = {"skipped": "no tritonserver on PATH and no nvidia-pytriton"}
        say("served: skipped (no tritonserver here)")
        return
    repository = settings.work / "model_repository" / engine_dir.name
    port, log = _free_port(), settings.work / "serve.log"
    c = max(settings.concurrencies)
    say(f"served: forge serve {repository.name}, the OpenAI demo request, forge bench c={c}")
    server = _start(repository, port, log)
    try:
        _wait_ready(server, log, remaining() or 600.0)
        answer = _demo_request(port, engine_dir.name)
        served = _bench(port, c, settings.prompt_len, settings.new_tokens, settings.work,
                        remaining())
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        report.extra["served"] = {"error": str(exc)[-2000:]}
        report.check("served: forge serve answers", False, "failed", "answers")
        return
    finally:
        server.terminate()
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            server.kill()
    in_process = next(row["tok_s"] for row in report.shapes[engine_dir.name]["speed"]
                      if row["concurrency"] == c)
    ratio = served / in_process
    report.extra["served"] = {"concurrency": c, "tok_s": served, "in_process_tok_s": in_process,
                              "ratio": ratio, "demo_answer": answer["choices"][0]["message"]}
    report.check("served: the OpenAI demo request answered", bool(answer.get("choices")),
                 answer["choices"][0].get("finish_reason"), "a choice")
    report.check(f"served c={c} >= {MIN_SERVED_RATIO:g}x in-process", ratio >= MIN_SERVED_RATIO,
                 round(ratio, 2), f">= {MIN_SERVED_RATIO:g}x", applied=settings.device == "cuda")

"""`forge bench memory`: what a pod of `forge serve` holds, idle and at its peak under load.

Starts `forge serve` on a repository as the rendered Deployment does (the OpenAI API on, every
Triton model loaded), samples the PSS (proportional set size: shared pages split between the
processes that map them, so libraries and /dev/shm count once, as a container's cgroup counts
them) and the RSS of every process under it every 0.2 s, idles, then sends `concurrency` streams
of long prompts through the OpenAI API for `seconds`. The runtime and peak that
`builder/deploy/memory.py` adds to an engine's weights and KV cache come from here
(docs/deploy.md, "Memory").
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from builder.bench.summary import Table, document
from builder.serving.serve import free_port

MIB = 2**20


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, from /proc (the soak's and the memory run's)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def memory_of(pid: int) -> tuple[str, int, int] | None:
    """(name, PSS bytes, RSS bytes) of one process; None once it is gone."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in rollup[1:]
              if line.split()[-1] == "kB"}
    return name, fields.get("Pss", 0), fields.get("Rss", 0)


class Sampler(threading.Thread):
    """The sums over the process tree, every `period` s; the peak of each and per process."""

    def __init__(self, root: int, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.stopping = threading.Event()
        self.peak_pss = self.peak_rss = 0
        self.by_process: dict[str, int] = {}  # PSS at the peak of the sum

    def sample(self) -> tuple[int, int, dict[str, int]]:
        found = [m for m in map(memory_of, process_tree(self.root)) if m is not None]
        by_process: dict[str, int] = {}
        for name, pss, _ in found:
            by_process[name] = by_process.get(name, 0) + pss
        return sum(m[1] for m in found), sum(m[2] for m in found), by_process

    def run(self) -> None:
        while not self.stopping.wait(self.period):
            pss, rss, by_process = self.sample()
            if pss > self.peak_pss:
                self.peak_pss, self.by_process = pss, by_process
            self.peak_rss = max(self.peak_rss, rss)


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> bool:
    """One streamed completion read to its end; False when the server was busy (429: its
    admission limits), which is no failure here: the client tries again."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            while reply.readline():
                pass
    except urllib.error.HTTPError as exc:
        if exc.code != 429:
            raise
        time.sleep(0.5)
        return False
    return True


@dataclass(frozen=True)
class Load:
    idle_seconds: float = 15.0
    seconds: float = 90.0
    concurrency: int = 32
    prompt_words: int = 1200
    max_tokens: int = 256


def _start(repository: Path, log: Path) -> tuple[subprocess.Popen, str, str]:
    """forge serve with its OpenAI API, once /v1/models answers: (process, base URL, model)."""
    port = free_port()
    with open(log, "wb") as sink:
        serve = subprocess.Popen(
            [sys.executable, "-m", "builder.cli", "serve", "--repository", str(repository),
             "--openai-port", str(port), "--health-port", "0", "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0"],
            stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + 900
    while True:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as reply:
                return serve, url, json.loads(reply.read())["data"][0]["id"]
        except OSError:
            if serve.poll() is not None or time.monotonic() > deadline:
                serve.kill()
                raise RuntimeError(f"forge serve did not come up (its output: {log})") from None
            time.sleep(1.0)


def _load(url: str, model: str, load: Load) -> int:
    """`load.concurrency` clients streaming for `load.seconds`; the requests that finished."""
    prompt, stop = " ".join(["memory"] * load.prompt_words), time.monotonic() + load.seconds
    finished = []

    def client() -> None:
        while time.monotonic() < stop:
            if _stream(url, model, prompt, load.max_tokens):
                finished.append(1)

    with ThreadPoolExecutor(load.concurrency) as pool:
        for future in [pool.submit(client) for _ in range(load.concurrency)]:
            future.result()
    return len(finished)


def run(repository: Path, load: Load, out: Path) -> dict:
    """The idle and peak sums (and by process) of a served repository, as a bench document."""
    out.mkdir(parents=True, exist_ok=True)
    serve, url, model = _start(repository, out / "forge-serve.log")
    try:
        sampler = Sampler(serve.pid)
        sampler.start()
        time.sleep(load.idle_seconds)
        idle_pss, idle_rss, idle_by_process = sampler.sample()
        requests = _load(url, model, load)
        time.sleep(2.0)
        sampler.stopping.set()
        sampler.join()
    finally:
        serve.terminate()
        serve.wait(120)
    table = Table(["measure", "MiB"], title=f"forge serve on {repository}")
    for name, value in (("idle PSS", idle_pss), ("peak PSS under load", sampler.peak_pss),
                        ("idle RSS", idle_rss), ("peak RSS under load", sampler.peak_rss)):
        table.add(name, f"{value / MIB:.0f}")
    for name, value in sorted(idle_by_process.items()):
        table.add(f"  idle PSS of {name}", f"{value / MIB:.0f}")
    notes = [f"{requests} requests finished under load; PSS counts shared pages once, RSS in "
             f"every process that maps them"]
    return document("forge bench memory", {"repository": str(repository), **asdict(load)},
                    [table], notes, requests=requests,
                    idle_pss_mib=round(idle_pss / MIB), peak_pss_mib=round(sampler.peak_pss / MIB),
                    idle_rss_mib=round(idle_rss / MIB), peak_rss_mib=round(sampler.peak_rss / MIB),
                    idle_pss_by_process_mib={k: round(v / MIB) for k, v in
                                             idle_by_process.items()},
                    peak_pss_by_process_mib={k: round(v / MIB) for k, v in
                                             sampler.by_process.items()})

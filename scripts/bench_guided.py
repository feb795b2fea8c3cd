"""What guided decoding costs on the demo model: tok/s at concurrency 16, guided vs not, the
first-use compile time of each guide, and the grammar cache's counters.

Builds the spec's engine and repository if missing, starts `forge serve --openai-port` on free
loopback ports, and runs, in turns (`--repeats`), three closed-loop workloads of chat requests
at `--concurrency` through the official `openai` client:

- `free`: unconstrained, every answer exactly `--tokens` tokens (`min_tokens` = `max_tokens`);
- `regex`: a regex that cannot end before `--tokens` tokens, so every step of every request
  computes a mask (the same lengths as `free`: a pure per-token cost);
- `schemas`: the 20 JSON schemas of tests/e2e/test_guided_e2e.py in turn (answers end when the
  document does, after 5 to 40 tokens);
- `twin`: unconstrained, request i exactly as long as request i of the `schemas` run just
  before it (`min_tokens` = `max_tokens`): the same prefills, lengths and order without masks.

Then it compiles every guide once in-process with the server's own compiler (cold cache) and
prints the compile times, and reads `guided_*` from the server's /metrics.

    python scripts/bench_guided.py [--spec examples/smollm2-135m.yaml] [--requests 48]

On a machine shared with other work the figures are noisy: compare turns of the same run.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the schemas of test_guided_e2e

from bench_compare import ensure_engine  # noqa: E402
from bench_openai import start_forge_serve  # noqa: E402

PROMPT = [{"role": "user", "content": "List some facts about the planets of the solar system."}]


def _workload(name: str, tokens: int, schemas: list[dict], lengths: list[int] | None = None):
    regex = "(yes|no)( (yes|no)){%d}" % (tokens + 8)

    def fields(i: int) -> dict:
        if name == "free":
            return {"max_tokens": tokens, "extra_body": {"min_tokens": tokens}}
        if name == "twin":
            return {"max_tokens": lengths[i], "extra_body": {"min_tokens": lengths[i]}}
        if name == "regex":
            return {"max_tokens": tokens, "extra_body": {"guided_regex": regex}}
        schema = schemas[i % len(schemas)]
        return {"max_tokens": 4 * tokens, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    return fields


def run_level(client, model: str, fields, requests: int, concurrency: int
              ) -> tuple[float, list[int]]:
    """(completion tokens per second, each request's completion tokens) of `requests`
    closed-loop requests."""
    def one(i: int) -> int:
        reply = client.chat.completions.create(model=model, messages=PROMPT, **fields(i))
        return reply.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        counts = list(pool.map(one, range(requests)))
    return sum(counts) / (time.perf_counter() - started), counts


def compile_times(engine: Path, schemas: list[dict]) -> list[tuple[str, float]]:
    from triton_backend.engine.config import EngineConfig
    from triton_backend.engine.guided import GuidedDecodingParams
    from triton_backend.engine.guided.compiler import GrammarCompiler

    config = EngineConfig.load(engine)
    compiler = GrammarCompiler(engine / config.tokenizer.dir, config.model.vocab_size,
                               config.tokenizer.eos_token_ids)
    started = time.perf_counter()
    compiler.tokenizer
    rows = [("tokenizer (once per engine)", time.perf_counter() - started)]
    guides = [(f"schema {i}", GuidedDecodingParams("json_schema", json.dumps(s)))
              for i, s in enumerate(schemas)]
    guides += [("regex", GuidedDecodingParams("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
               ("ebnf", GuidedDecodingParams("ebnf_grammar", 'root ::= ("yes" | "no") " " [a-z]+'))]
    for label, params in guides:
        rows.append((label, compiler.compile(params).compile_seconds))
    return rows


def guided_stats(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'llm_forge_executor_stats\{[^}]*stat="(guided_\w+)"[^}]*\} ([0-9.e+-]+)'
    return {name: float(value) for name, value in re.findall(pattern, text)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "smollm2-135m.yaml")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--log", type=Path, default=ROOT / "bench" / "guided-serve.log")
    args = parser.parse_args()
    import openai
    from test_guided_e2e import SCHEMAS

    engine, repository = ensure_engine(args.spec, rebuild=False)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    process, openai_url, _ = start_forge_serve(repository, args.log)
    try:
        metrics_port = _metrics_port(args.log)
        client = openai.OpenAI(base_url=f"http://{openai_url}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        run_level(client, model, _workload("free", 8, SCHEMAS), args.concurrency, args.concurrency)
        rates: dict[str, list[float]] = {"free": [], "regex": [], "schemas": [], "twin": []}
        tokens: dict[str, int] = {}
        lengths: list[int] = []
        for turn in range(args.repeats):
            order = ["free", "regex"] if turn % 2 == 0 else ["regex", "free"]
            for name in order + ["schemas", "twin"]:
                rate, counts = run_level(client, model,
                                         _workload(name, args.tokens, SCHEMAS, lengths),
                                         args.requests, args.concurrency)
                if name == "schemas":
                    lengths = counts
                rates[name].append(rate)
                tokens[name] = sum(counts)
                print(f"[bench-guided] turn {turn + 1} {name}: {rate:.1f} tok/s", flush=True)
        stats = guided_stats(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    print(f"\nc={args.concurrency}, {args.requests} requests per workload, median of "
          f"{args.repeats} turns\n")
    print("| workload | tok/s | vs its unconstrained twin | tokens per request | turns |")
    print("|---|---|---|---|---|")
    twin = {"free": "free", "regex": "free", "schemas": "twin", "twin": "twin"}
    for name, values in rates.items():
        rate = statistics.median(values)
        base = statistics.median(rates[twin[name]])
        print(f"| {name} | {rate:.1f} | {rate / base:.0%} | {tokens[name] / args.requests:.0f} "
              f"| {', '.join(f'{v:.0f}' for v in values)} |")
    print("\n| guide | first-use compile ms |")
    print("|---|---|")
    for label, seconds in compile_times(engine, SCHEMAS):
        print(f"| {label} | {seconds * 1e3:.1f} |")
    print("\nserver counters: " + ", ".join(f"{k} {v:g}" for k, v in sorted(stats.items())))
    return 0


def _metrics_port(log: Path) -> int:
    """forge serve prints its endpoints; the metrics one is read from its log."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = re.search(r"127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        time.sleep(0.5)
    raise RuntimeError(f"no metrics endpoint in {log}")


if __name__ == "__main__":
    sys.exit(main())

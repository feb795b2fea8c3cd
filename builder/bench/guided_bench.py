"""`forge bench guided`: what guided decoding costs, served. The spec's repository through
`forge serve` and the official `openai` client, closed loops of chat requests in turns:
- `free`: unconstrained, every answer exactly `tokens` tokens (`min_tokens` = `max_tokens`);
- `regex`: a regex that cannot end before `tokens` tokens (a mask at every step of every
  request, the same lengths as `free`: a pure per-token cost);
- `schemas`: the 20 JSON schemas of `guided_schemas` in turn (answers end with the document);
- `twin`: unconstrained, request i exactly as long as request i of the `schemas` run before it.
Then every guide compiled once in-process with the server's own compiler (cold cache), and the
server's `guided_*` counters."""
from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from builder.bench.guided_schemas import SCHEMAS
from builder.bench.summary import Table, document

PROMPT = [{"role": "user", "content": "List some facts about the planets of the solar system."}]
WORKLOADS = ("free", "regex", "schemas", "twin")


def request_fields(name: str, tokens: int, lengths: list[int]) -> Callable[[int], dict]:
    regex = "(yes|no)( (yes|no)){%d}" % (tokens + 8)

    def fields(i: int) -> dict:
        if name == "free":
            return {"max_tokens": tokens, "extra_body": {"min_tokens": tokens}}
        if name == "twin":
            return {"max_tokens": lengths[i], "extra_body": {"min_tokens": lengths[i]}}
        if name == "regex":
            return {"max_tokens": tokens, "extra_body": {"guided_regex": regex}}
        return {"max_tokens": 4 * tokens, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": SCHEMAS[i % len(SCHEMAS)]}}}
    return fields


def run_level(client: Any, model: str, fields: Callable[[int], dict], requests: int,
              concurrency: int) -> tuple[float, list[int]]:
    """(completion tokens per second, each request's completion tokens) of a closed loop."""
    def one(i: int) -> int:
        reply = client.chat.completions.create(model=model, messages=PROMPT, **fields(i))
        return reply.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        counts = list(pool.map(one, range(requests)))
    return sum(counts) / (time.perf_counter() - started), counts


def compile_times(engine: Path) -> list[tuple[str, float]]:
    from triton_backend.engine.config import EngineConfig
    from triton_backend.engine.guided import GuidedDecodingParams
    from triton_backend.engine.guided.compiler import GrammarCompiler

    config = EngineConfig.load(engine)
    compiler = GrammarCompiler(engine / config.tokenizer.dir, config.model.vocab_size,
                               config.tokenizer.eos_token_ids)
    started = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built on first use: that is what is timed
    rows = [("tokenizer (once per engine)", time.perf_counter() - started)]
    guides = [(f"schema {i}", GuidedDecodingParams("json_schema", json.dumps(s)))
              for i, s in enumerate(SCHEMAS)]
    guides += [("regex", GuidedDecodingParams("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
               ("ebnf", GuidedDecodingParams("ebnf_grammar", 'root ::= ("yes" | "no") " " [a-z]+'))]
    return rows + [(label, compiler.compile(params).compile_seconds) for label, params in guides]


def run(spec: str, out: Path, requests: int, concurrency: int, tokens: int, repeats: int
        ) -> dict[str, Any]:
    import openai

    from builder.bench.server_stats import scrape
    from builder.bench.servers import ensure_repository, forge_serve

    engine, repository = ensure_repository(spec)
    out.mkdir(parents=True, exist_ok=True)
    server, endpoints = forge_serve(repository, out / "forge-serve.log")
    rates: dict[str, list[float]] = {name: [] for name in WORKLOADS}
    counts: dict[str, int] = {}
    with server:
        client = openai.OpenAI(base_url=f"http://{endpoints.openai}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        run_level(client, model, request_fields("free", 8, []), concurrency, concurrency)
        lengths: list[int] = []
        for turn in range(repeats):
            for name in (["free", "regex"] if turn % 2 == 0 else ["regex", "free"]) + [
                    "schemas", "twin"]:
                rate, per_request = run_level(client, model, request_fields(name, tokens, lengths),
                                              requests, concurrency)
                lengths = per_request if name == "schemas" else lengths
                rates[name].append(rate)
                counts[name] = sum(per_request)
                print(f"[bench guided] turn {turn + 1} {name}: {rate:.1f} tok/s", flush=True)
        stats = {k: v for k, v in scrape(f"http://{endpoints.metrics}/metrics").items()
                 if k.startswith("guided_")}
    table = Table(["workload", "tok/s (median)", "vs its unconstrained twin", "tokens per request",
                   "turns"], title=f"c={concurrency}, {requests} requests per workload")
    twin = {"free": "free", "regex": "free", "schemas": "twin", "twin": "twin"}
    for name, values in rates.items():
        rate, base = statistics.median(values), statistics.median(rates[twin[name]])
        table.add(name, f"{rate:.1f}", f"{rate / base:.0%}", f"{counts[name] / requests:.0f}",
                  ", ".join(f"{v:.0f}" for v in values))
    compiles = Table(["guide", "first-use compile ms"])
    for label, seconds in compile_times(engine):
        compiles.add(label, f"{seconds * 1e3:.1f}")
    return document("forge bench guided", {
        "spec": spec, "requests": requests, "concurrency": concurrency, "tokens": tokens,
        "repeats": repeats}, [table, compiles],
        ["server counters: " + ", ".join(f"{k} {v:g}" for k, v in sorted(stats.items()))],
        rates_tok_s=rates, server_counters=stats)

"""A whole benchmark: every concurrency level against one server, or two servers alternating.

With two targets each level runs on A then B (the order flips every level, so neither server
always enjoys a freshly idle machine), on the same requests; each level and the warm-up send
prompts of their own (`Workload.items_for`). Results are plain dicts, ready for
`results.json`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from builder.bench.clients import ModelInputs, fetch_model_inputs, make_client
from builder.bench.loadgen import LevelPlan, LevelRun, run_level
from builder.bench.records import RequestRecord
from builder.bench.server_stats import level_delta, scrape
from builder.bench.stats import summarize
from builder.bench.summary import document
from builder.bench.workloads import WorkItem, Workload


@dataclass(frozen=True)
class Target:
    """A server to measure: `url` is host:port of its gRPC (or HTTP, or OpenAI) endpoint.
    `model` None on an OpenAI endpoint means the model it serves."""

    label: str
    url: str
    model: str | None = "ensemble"
    protocol: str = "grpc"
    metrics_url: str | None = None  # its /metrics: the server's own counters per level


def _resolved(target: Target) -> Target:
    if target.protocol != "openai" or target.model:
        return target
    from builder.bench.openai_client import served_models

    served = served_models(target.url)
    if not served:
        raise ValueError(f"{target.label}: {target.url} serves no model")
    return dataclasses.replace(target, model=served[0])


@dataclass(frozen=True)
class BenchSettings:
    concurrencies: tuple[int, ...]
    requests: str | None = None  # "N" per level, or "Kx" = K x concurrency
    duration_s: float | None = None
    rate: float | None = None
    warmup: int = 2
    timeout_s: float = 600.0
    fixed_output: bool = True
    seed: int = 0
    keep_text: bool = False

    def num_requests(self, concurrency: int) -> int | None:
        """Requests at one level; `Kx` scales with concurrency so every slot stays busy."""
        if self.requests is None:
            return None
        text = str(self.requests).strip().lower()
        value = int(text[:-1]) * concurrency if text.endswith("x") else int(text)
        if value < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests!r}")
        return value

    def plan(self, concurrency: int) -> LevelPlan:
        duration = self.duration_s if self.requests is None else None
        return LevelPlan(concurrency, self.num_requests(concurrency), duration, self.rate, self.seed)


STATS_SETTLE_S = 0.5  # > the repository's stats_period_ms (100 ms by default)
WARMUP_ROUND = "warmup"
ProgressFactory = Callable[[str, int | None], Callable[[RequestRecord], None]]


def _warmup(target: Target, inputs: ModelInputs, workload: Workload, settings: BenchSettings) -> None:
    """Untimed requests first: lazy initialisation must not land in the c=1 numbers."""
    if settings.warmup <= 0:
        return
    client = make_client(target.protocol, target.url, target.model, inputs,
                         settings.fixed_output, settings.timeout_s)
    try:
        items = workload.items_for(WARMUP_ROUND)
        for i in range(settings.warmup):
            client.send(items[i % len(items)], -1 - i, time.perf_counter())
    finally:
        client.close()


def _run_one(target: Target, inputs: ModelInputs, items: list[WorkItem], plan: LevelPlan,
             settings: BenchSettings, tokenizer: Any | None, progress: ProgressFactory | None
             ) -> dict[str, Any]:
    clients = [make_client(target.protocol, target.url, target.model, inputs,
                           settings.fixed_output, settings.timeout_s)
               for _ in range(plan.concurrency)]
    on_done = progress(f"{target.label} c={plan.concurrency}", plan.num_requests) if progress else None
    before = scrape(target.metrics_url) if target.metrics_url else None
    try:
        run: LevelRun = run_level(clients, items, plan, on_done)
    finally:
        for client in clients:
            client.close()
    for record in run.records:
        record.count_output_tokens(tokenizer)
    summary = summarize(run.records, run.wall_s, plan.concurrency)
    if before is not None:
        time.sleep(STATS_SETTLE_S)  # the server publishes its counters periodically
        summary["server"] = level_delta(before, scrape(target.metrics_url))
    summary["requests_detail"] = [r.to_dict(settings.keep_text) for r in run.records]
    return summary


def run_bench(targets: list[Target], workload: Workload, settings: BenchSettings,
              tokenizer: Any | None = None, progress: ProgressFactory | None = None,
              on_level: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every level on every target; returns the `results.json` document.

    `on_level` gets the document so far after every level (to save partial results: an
    interrupted run still leaves the levels it finished)."""
    if not 1 <= len(targets) <= 2:
        raise ValueError(f"bench compares one or two servers, got {len(targets)}")
    targets = [_resolved(t) for t in targets]
    inputs = {t.label: fetch_model_inputs(t.url, t.model, t.protocol) for t in targets}
    for target in targets:
        missing = [n for n in ("text_input", "max_tokens") if not inputs[target.label].accepts(n)]
        if missing:
            raise ValueError(f"{target.label}: model {target.model!r} has no input {missing[0]}")
        _warmup(target, inputs[target.label], workload, settings)
    result = _document(targets, inputs, workload, settings)
    levels = {t["label"]: t["levels"] for t in result["targets"]}
    for n, concurrency in enumerate(settings.concurrencies):
        order = targets if n % 2 == 0 else list(reversed(targets))
        items = workload.items_for(None if n == 0 else f"level{n}")  # the same on both targets
        for target in order:
            levels[target.label].append(_run_one(target, inputs[target.label], items,
                                                 settings.plan(concurrency), settings,
                                                 tokenizer, progress))
            if len(targets) == 2:
                result["comparison"] = compare_levels(levels[targets[0].label],
                                                      levels[targets[1].label])
            if on_level is not None:
                on_level(result)
    return result


def _document(targets: list[Target], inputs: dict[str, ModelInputs], workload: Workload,
              settings: BenchSettings) -> dict[str, Any]:
    return document("forge bench", {**asdict(settings),
                                    "concurrencies": list(settings.concurrencies)}, [],
                    workload=workload.describe(),
                    targets=[{**asdict(t), "fixed_output_honoured":
                              inputs[t.label].accepts("min_tokens"), "levels": []}
                             for t in targets])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_levels(a_levels: list[dict], b_levels: list[dict]) -> list[dict[str, Any]]:
    """Per concurrency: A/B ratios (throughput > 1 means A is faster; TTFT < 1 means A is faster)."""
    rows = []
    for a, b in zip(a_levels, b_levels):  # zip: a partial run may have one level more on A
        rows.append({
            "concurrency": a["concurrency"],
            "output_tokens_per_s_ratio": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "requests_per_s_ratio": _ratio(a["requests_per_s"], b["requests_per_s"]),
            "ttft_p50_ratio": _ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]),
            "ttft_p99_ratio": _ratio(a["ttft_s"]["p99"], b["ttft_s"]["p99"]),
            "ttft_p99_s": [a["ttft_s"]["p99"], b["ttft_s"]["p99"]],
            "itl_p50_ratio": _ratio(a["itl_s"]["p50"], b["itl_s"]["p50"]),
            "e2e_p50_ratio": _ratio(a["e2e_s"]["p50"], b["e2e_s"]["p50"]),
        })
    return rows

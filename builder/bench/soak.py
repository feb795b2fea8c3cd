"""`forge bench soak`: overload and soak against a real tritonserver (the `tensorrt_llm` model over
gRPC streams). From an engine it emits two repositories, one admitting `max_waiting_requests`
(default 4, a quarter of the batch) for capacity, overload and soak, one with the spec's bound (a
queue) for the priority phase; each gets its own server. Phases (one given 0 seconds or requests
is skipped):
  capacity  closed loop at `concurrency` streams: sustained requests/s and TTFT (p50, p99)
  overload  Poisson arrivals at `overload_factor` x capacity: every request ends in output, a
            busy rejection, a deadline error or a cancellation (lost == 0); admitted TTFT p99
  soak      `soak_requests` requests, 20% cancelled or disconnected mid-stream at random; then
            0 KV blocks used, 0 requests tracked by executor or model
  priority  more streams than the batch holds, a share at high priority: TTFT p50 of each class
            (high <= 1/3 of low), every low-priority request finishes
RSS of every process under tritonserver is sampled through overload and soak: the mean of the
last quarter against the first after warm-up. Fails if a request was lost, state leaked, a
low-priority request starved or a bound was missed."""
from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from builder.bench.soak_load import (Client, RssSampler, errors_of, outcome_counts,
                                     run_closed_loop, run_open_loop)
from builder.bench.stats import percentiles
from builder.bench.summary import Table, document
from builder.client.metrics_reader import scrape


@dataclass(frozen=True)
class Soak:
    concurrency: int = 16
    capacity_seconds: float = 30
    overload_factor: float = 4.0
    overload_seconds: float = 120
    soak_requests: int = 3000
    soak_rate_factor: float = 1.0
    cancel_fraction: float = 0.2
    prompt_len: int = 16
    max_tokens: int = 16
    deadline: float = 60.0
    max_in_flight: int = 1024
    priority_concurrency: int = 48
    priority_seconds: float = 60
    high_fraction: float = 0.25
    high_priority: int = 10
    max_waiting_requests: int = 4
    priority_max_waiting_requests: int | None = None
    engine_threads: int = 0
    warmup_seconds: float = 20
    malloc: str = "auto"


def percentile(values: list[float], q: int) -> float:
    """`forge bench`'s percentile; NaN when empty, so ratios stay numbers."""
    value = percentiles(values, (q,))[f"p{q}"]
    return float("nan") if value is None else value


def wait_idle(metrics_url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = scrape(metrics_url).totals()
        busy = sum(stats.get(k, 0) for k in ("num_used_blocks", "num_active_requests",
                                             "num_waiting_requests", "num_queued_requests",
                                             "model_active_requests", "model_tracked_ids"))
        if busy == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def _ttfts(records: list[dict], key: str = "ttft") -> list[float]:
    return [r[key] for r in records if r["outcome"] == "output" and r.get(key) is not None]


async def load_phases(s: Soak, server: Any, sampler: RssSampler, report: dict) -> None:
    """capacity, then overload and soak as chosen; figures into `report`."""
    client = sampler.client = Client(server.grpc_url, s.prompt_len, s.max_tokens, s.deadline)
    try:
        print(f"[soak] warm-up (5 s), then capacity: {s.concurrency} streams", flush=True)
        await run_closed_loop(client, s.concurrency, 5.0)  # one-time costs, not measured
        t0 = time.monotonic()
        capacity = await run_closed_loop(client, s.concurrency, s.capacity_seconds)
        ok = [r for r in capacity if r["outcome"] == "output"]
        rate = len(ok) / (time.monotonic() - t0)
        if not ok:
            raise RuntimeError(f"capacity phase: no request completed: "
                               f"{outcome_counts(capacity)} {capacity[:1]}")
        cap = report["capacity"] = {
            "requests": len(capacity), "ok": len(ok), "req_per_s": rate,
            "ttft_p50_s": percentile(_ttfts(capacity), 50),
            "ttft_p99_s": percentile(_ttfts(capacity), 99),
            "server_ttft_p99_s": percentile(_ttfts(capacity, "server_ttft"), 99)}
        warm_at, report["rss"] = time.monotonic() + s.warmup_seconds, {}
        if s.overload_seconds > 0:
            offered = rate * s.overload_factor
            print(f"[soak] overload: {offered:.2f} req/s for {s.overload_seconds:.0f} s", flush=True)
            sent, records, achieved = await run_open_loop(client, offered, s.overload_seconds,
                                                          max_in_flight=s.max_in_flight)
            p99, server_p99 = (percentile(_ttfts(records, k), 99) for k in ("ttft", "server_ttft"))
            report["overload"] = {
                "offered_req_per_s": offered, "achieved_req_per_s": achieved, "sent": sent,
                "ended": len(records), "lost": sent - len(records),
                "outcomes": outcome_counts(records), "ttft_p99_s": p99,
                "ttft_p99_vs_capacity": p99 / cap["ttft_p99_s"], "server_ttft_p99_s": server_p99,
                "server_ttft_p99_vs_capacity": server_p99 / cap["server_ttft_p99_s"],
                "errors": errors_of(records)}
            report["rss"]["overload"] = sampler.flatness(warm_at, time.monotonic())
            report["after_overload"] = await asyncio.to_thread(wait_idle, server.metrics_url)
        if s.soak_requests > 0:
            def action(rng: random.Random) -> str:
                if rng.random() >= s.cancel_fraction:
                    return "complete"
                return rng.choice(["cancelled", "disconnected"])

            soak_at = max(warm_at, time.monotonic())
            print(f"[soak] soak: {s.soak_requests} requests", flush=True)
            sent, records, _ = await run_open_loop(client, rate * s.soak_rate_factor, 0, action,
                                                   count=s.soak_requests,
                                                   max_in_flight=s.max_in_flight)
            idle = await asyncio.to_thread(wait_idle, server.metrics_url)
            report["soak"] = {
                "sent": sent, "ended": len(records), "lost": sent - len(records),
                "outcomes": outcome_counts(records),
                "leaked_kv_blocks": idle.get("num_used_blocks"),
                "leaked_executor_requests": sum(idle.get(k, 0) for k in (
                    "num_active_requests", "num_waiting_requests", "num_queued_requests")),
                "leaked_model_requests": idle.get("model_active_requests", 0)
                + idle.get("model_tracked_ids", 0), "errors": errors_of(records)}
            report["rss"]["soak"] = sampler.flatness(soak_at, time.monotonic())
        sampler.stopping.set()
        report["rss_series_mib"] = sampler.series(warm_at)
    finally:
        await client.close()


async def priority_phase(s: Soak, server: Any, report: dict) -> None:
    """Closed loop over the batch with a share of high-priority requests."""
    client = Client(server.grpc_url, s.prompt_len, s.max_tokens, s.deadline)
    try:
        await run_closed_loop(client, s.concurrency, 5.0)  # warm-up
        print(f"[soak] priority: {s.priority_concurrency} streams, {s.high_fraction:.0%} at "
              f"priority {s.high_priority}, {s.priority_seconds:.0f} s", flush=True)
        records = await run_closed_loop(
            client, s.priority_concurrency, s.priority_seconds,
            lambda rng: s.high_priority if rng.random() < s.high_fraction else 0)
        prio = report["priority"] = {}
        for name, level in (("high", s.high_priority), ("low", 0)):
            mine = [r for r in records if r["priority"] == level]
            prio[name] = {"requests": len(mine), "outcomes": outcome_counts(mine),
                          "ttft_p50_s": percentile(_ttfts(mine), 50),
                          "ttft_p99_s": percentile(_ttfts(mine), 99),
                          "server_ttft_p50_s": percentile(_ttfts(mine, "server_ttft"), 50)}
        high, low = prio["high"], prio["low"]
        prio["ttft_p50_high_vs_low"] = high["ttft_p50_s"] / low["ttft_p50_s"]
        prio["server_ttft_p50_high_vs_low"] = high["server_ttft_p50_s"] / low["server_ttft_p50_s"]
        prio["low_unfinished"] = low["requests"] - low["outcomes"].get("output", 0)
        report["after_priority"] = await asyncio.to_thread(wait_idle, server.metrics_url)
    finally:
        await client.close()


def repositories(s: Soak, engine: str | None, repository: str | None) -> tuple[Path, Path]:
    if repository:
        return Path(repository), Path(repository)
    from builder.repository.emit import RepositoryOptions, emit_repository
    from builder.spec.build_spec import ServingSpec

    workdir = Path(tempfile.mkdtemp(prefix="forge-soak-"))
    options = RepositoryOptions(stats_period_ms=100, engine_num_threads=s.engine_threads)
    return tuple(emit_repository(Path(engine), workdir / name, options, ServingSpec(
        **({} if bound is None else {"max_waiting_requests": bound})))
        for name, bound in (("load", s.max_waiting_requests),
                            ("priority", s.priority_max_waiting_requests)))


def run(s: Soak, engine: str | None, repository: str | None) -> tuple[dict, bool]:
    from builder.serving.serve import start_tritonserver

    load_repository, priority_repository = repositories(s, engine, repository)
    report: dict = {}
    if s.overload_seconds > 0 or s.soak_requests > 0:
        with start_tritonserver(load_repository, ready_timeout=600, malloc=s.malloc) as server:
            report["allocator"] = server.allocator
            sampler = RssSampler(server.process.pid)
            sampler.start()
            try:
                asyncio.run(load_phases(s, server, sampler, report))
            finally:
                sampler.stopping.set()
    if s.priority_seconds > 0:
        with start_tritonserver(priority_repository, ready_timeout=600, malloc=s.malloc) as server:
            asyncio.run(priority_phase(s, server, report))
    table, failed = report_table(report)
    return document("forge bench soak", {**asdict(s), "engine": engine, "repository": repository},
                    [table], ["FAILED: a request was lost, state leaked, a low-priority request "
                              "starved, or a bound was missed (TTFT p99 under overload <= 3x "
                              "capacity's, high/low TTFT p50 <= 1/3, RSS growth within 5%)"]
                    if failed else [], **report), not failed


def report_table(report: dict) -> tuple[Table, bool]:
    table, failed = Table(["measure", "value"]), False
    table.add("tritonserver malloc", report.get("allocator", "-"))
    cap, over = report.get("capacity"), report.get("overload")
    if cap:
        table.add("capacity req/s", f"{cap['req_per_s']:.2f}")
        table.add("capacity TTFT p50 / p99 (s)", f"{cap['ttft_p50_s']:.3f} / {cap['ttft_p99_s']:.3f}")
    if over:
        table.add("overload offered / achieved req/s",
                  f"{over['offered_req_per_s']:.2f} / {over['achieved_req_per_s']:.2f} "
                  f"({over['achieved_req_per_s'] / cap['req_per_s']:.2f}x capacity)")
        table.add("overload sent / ended / lost", f"{over['sent']} / {over['ended']} / {over['lost']}")
        table.add("overload outcomes", json.dumps(over["outcomes"]))
        table.add("overload TTFT p99 admitted (s)",
                  f"{over['ttft_p99_s']:.3f} ({over['ttft_p99_vs_capacity']:.2f}x capacity)")
        table.add("  server side (arrival -> first token)",
                  f"{over['server_ttft_p99_s']:.3f} ({over['server_ttft_p99_vs_capacity']:.2f}x "
                  f"capacity's {cap['server_ttft_p99_s']:.3f})")
        failed = failed or bool(over["lost"]) or over["ttft_p99_vs_capacity"] > 3
    soak = report.get("soak")
    if soak:
        table.add("soak sent / ended / lost", f"{soak['sent']} / {soak['ended']} / {soak['lost']}")
        table.add("soak outcomes", json.dumps(soak["outcomes"]))
        table.add("soak leaked KV blocks", f"{soak['leaked_kv_blocks']:.0f}")
        table.add("soak leaked requests (executor / model)",
                  f"{soak['leaked_executor_requests']:.0f} / {soak['leaked_model_requests']:.0f}")
        failed = failed or bool(soak["lost"] or soak["leaked_kv_blocks"]
                                or soak["leaked_executor_requests"] or soak["leaked_model_requests"])
    prio = report.get("priority")
    if prio:
        high, low = prio["high"], prio["low"]
        table.add("priority requests high / low", f"{high['requests']} / {low['requests']}")
        table.add("priority TTFT p50 high / low (s)", f"{high['ttft_p50_s']:.3f} / "
                  f"{low['ttft_p50_s']:.3f} ({prio['ttft_p50_high_vs_low']:.2f}x)")
        table.add("  server side (arrival -> first token)", f"{high['server_ttft_p50_s']:.3f} / "
                  f"{low['server_ttft_p50_s']:.3f} ({prio['server_ttft_p50_high_vs_low']:.2f}x)")
        table.add("priority low-priority unfinished", prio["low_unfinished"])
        failed = failed or bool(prio["low_unfinished"]) or prio["ttft_p50_high_vs_low"] > 1 / 3
    for phase, processes in report.get("rss", {}).items():
        for name, rss in sorted(processes.items()):
            failed = failed or rss["growth_pct"] > 5  # memory given back is no leak
            table.add(f"RSS {phase} {name} (MiB)", f"{rss['first_mib']:.1f} -> "
                      f"{rss['last_mib']:.1f} ({rss['growth_pct']:+.1f}%)")
    return table, failed

"""Overload and soak run against a real tritonserver (the tensorrt_llm model over gRPC streams).

  python scripts/soak.py [--repository DIR] [--overload-seconds 120] [--soak-requests 3000]

Without --repository a tiny random-weight engine is built in a temp dir with two repositories:
one admitting --max-waiting-requests (default 4, a quarter of the batch) for capacity, overload
and soak, one with the spec's bound (a queue) for the priority phase; each gets its own server.
The load comes from one asyncio event loop over one gRPC channel with persistent streams, so a
2-core machine that also runs the server can offer several times capacity. Phases (a phase
given 0 seconds or requests is skipped):
  capacity  closed loop at --concurrency streams: sustained requests/s and TTFT (median, p99)
  overload  open loop (Poisson arrivals) at --overload-factor x capacity for --overload-seconds;
            every request must end in output, a busy rejection, a deadline error or a
            cancellation (ended == sent, lost == 0); TTFT p99 of admitted requests vs capacity
  soak      --soak-requests requests, 20% cancelled or disconnected mid-stream at random;
            afterwards 0 KV blocks used, 0 requests tracked by executor or model
  priority  closed loop at --priority-concurrency streams (more than the batch holds, so a
            queue forms) for --priority-seconds, --high-fraction of them at priority
            --high-priority, the rest at 0: TTFT p50 of each class (high <= 1/3 of low) and
            every low-priority request finishes (none starves)
RSS of tritonserver and every process under it (stubs, engine process) is sampled through
overload and soak; "flat" compares the mean of the last quarter with the first quarter after warm-up.
Prints a table and writes JSON (--out); exits 1 if a request was lost, state leaked, a
low-priority request starved or a bound was missed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.bench.stats import percentiles  # noqa: E402  (after the path above)
from builder.metrics_reader import scrape  # noqa: E402


def percentile(values, q) -> float:
    """`forge bench`'s percentile (linear interpolation); NaN when empty, so ratios stay numbers."""
    value = percentiles(values, (q,))[f"p{q}"]
    return float("nan") if value is None else value


def process_tree(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def rss_by_process(root_pid: int) -> dict[str, int]:
    rss = {}
    for pid in process_tree(root_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                      .splitlines() if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        rss[f"{name}[{pid}]"] = kb * 1024
    return rss


class RssSampler(threading.Thread):
    def __init__(self, root_pid: int, period: float = 1.0):
        super().__init__(daemon=True)
        self.root_pid, self.period, self.samples = root_pid, period, []
        self.stopping = threading.Event()
        self.client: Client | None = None  # its peak of requests in flight goes in the series

    def run(self):
        while not self.stopping.wait(self.period):
            peak = self.client.take_peak() if self.client is not None else None
            self.samples.append((time.monotonic(), rss_by_process(self.root_pid), peak))

    def flatness(self, since: float, until: float = float("inf")) -> dict[str, dict]:
        """Per process: mean RSS of the first and last quarter of the samples in the window."""
        samples = [s for t, s, _ in self.samples if since <= t <= until]
        result = {}
        if len(samples) < 4:
            return result
        quarter = max(1, len(samples) // 4)
        for name in samples[-1]:
            first = [s[name] for s in samples[:quarter] if name in s]
            last = [s[name] for s in samples[-quarter:] if name in s]
            if first and last:
                a, b = statistics.mean(first), statistics.mean(last)
                result[name] = {"first_mib": a / 2**20, "last_mib": b / 2**20,
                                "growth_pct": 100 * (b - a) / a}
        return result

    def series(self, since: float) -> list[dict]:
        """Every sample from `since`: seconds, MiB per process and the client's peak of
        requests in flight since the sample before (memory tends to follow those peaks)."""
        return [dict(t=round(t - since, 1), in_flight_peak=peak,
                     **{k: round(v / 2**20, 2) for k, v in s.items()})
                for t, s, peak in self.samples if t >= since]


class _Stream:
    """One bidirectional ModelStreamInfer call, carrying one request at a time."""

    def __init__(self, stub, channel=None):
        self.call, self.channel = stub.ModelStreamInfer(), channel

    async def drop(self):
        self.call.cancel()
        if self.channel is not None:  # a disconnect: the connection itself goes
            await self.channel.close()


class Client:
    """Streaming requests to the tensorrt_llm model over one gRPC channel, outcome classified.

    Persistent streams, one request at a time on each (Triton's stream errors carry no request
    id, so an error belongs to the request its stream is serving), pooled in one event loop: a
    thread and a connection per request cannot offer several times capacity from a machine whose
    cores the server shares. A cancelled request cancels its stream; a disconnected one closes
    its own connection mid-stream."""

    OUTPUTS = ("output_ids", "arrival_time_ns", "first_token_time_ns")

    def __init__(self, url: str, prompt_len: int, max_tokens: int, deadline: float):
        self.url, self.prompt_len, self.max_tokens, self.deadline = (url, prompt_len, max_tokens,
                                                                     deadline)
        self.channel = self._connect()
        self.idle: list[_Stream] = []
        self.in_flight = self.peak_in_flight = 0
        self._requests: dict[int, object] = {}

    def _connect(self):
        import grpc

        return grpc.aio.insecure_channel(self.url)

    def _stub(self, channel):
        from tritonclient.grpc import service_pb2_grpc

        return service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def request(self, priority: int = 0):
        """The (cached) ModelInferRequest for a prompt of `prompt_len` tokens at `priority`."""
        if priority not in self._requests:
            from tritonclient.grpc import service_pb2

            ids = np.array([[5 + (i % 300) for i in range(self.prompt_len)]], np.int32)
            inputs = {"input_ids": ids, "input_lengths": np.array([[self.prompt_len]], np.int32),
                      "request_output_len": np.array([[self.max_tokens]], np.int32),
                      "streaming": np.array([[True]])}
            if priority:
                inputs["priority"] = np.array([[priority]], np.int32)
            request = service_pb2.ModelInferRequest(model_name="tensorrt_llm")
            request.parameters["triton_enable_empty_final_response"].bool_param = True
            for name, array in inputs.items():
                request.inputs.add(name=name, shape=list(array.shape),
                                   datatype={np.int32: "INT32", np.bool_: "BOOL"}[array.dtype.type])
                request.raw_input_contents.append(array.tobytes())  # in input order
            for name in self.OUTPUTS:
                request.outputs.add(name=name)
            self._requests[priority] = request
        return self._requests[priority]

    async def run(self, action: str = "complete", priority: int = 0) -> dict:
        import grpc

        if action == "disconnected":
            channel = self._connect()
            stream = _Stream(self._stub(channel), channel)
        else:
            stream = self.idle.pop() if self.idle else _Stream(self._stub(self.channel))
        record = {"outcome": None, "ttft": None, "tokens": 0}
        keep = False
        start = time.monotonic()
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await stream.call.write(self.request(priority))
            while True:
                remaining = self.deadline - (time.monotonic() - start)
                try:
                    reply = await asyncio.wait_for(stream.call.read(), max(0.01, remaining))
                except asyncio.TimeoutError:
                    record["outcome"] = "deadline"
                    return record
                if reply is grpc.aio.EOF:
                    record["outcome"], record["error"] = "error", "stream ended"
                    return record
                if reply.error_message:
                    text = reply.error_message.lower()
                    record["outcome"] = "busy" if "busy" in text else (
                        "deadline" if "deadline" in text or "timeout" in text else "error")
                    record["error"] = reply.error_message[:200]
                    keep = True
                    return record
                response = reply.infer_response
                outputs = {o.name: raw for o, raw in zip(response.outputs,
                                                         response.raw_output_contents)}
                n = len(outputs.get("output_ids", b"")) // 4
                if n and record["ttft"] is None:
                    record["ttft"] = time.monotonic() - start
                    # the server's own view: arrival at the model -> first token out
                    if "first_token_time_ns" in outputs and "arrival_time_ns" in outputs:
                        first = np.frombuffer(outputs["first_token_time_ns"], np.int64)[0]
                        arrival = np.frombuffer(outputs["arrival_time_ns"], np.int64)[0]
                        record["server_ttft"] = int(first - arrival) / 1e9
                record["tokens"] += n
                if action != "complete" and record["tokens"] > 0:
                    record["outcome"] = action
                    return record
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    record["outcome"] = "output"
                    keep = True
                    return record
        except grpc.aio.AioRpcError as exc:
            record["outcome"], record["error"] = "error", f"{exc.code()}: {exc.details()}"[:200]
            return record
        except Exception as exc:  # noqa: BLE001 - counted, never hidden
            record["outcome"], record["error"] = "error", repr(exc)[:200]
            return record
        finally:
            self.in_flight -= 1
            if keep and stream.channel is None:  # a disconnect's own connection is not pooled
                self.idle.append(stream)
            else:
                await stream.drop()

    def take_peak(self) -> int:
        """Most requests in flight at once since the last call."""
        peak, self.peak_in_flight = self.peak_in_flight, self.in_flight
        return peak

    async def close(self):
        for stream in self.idle:
            stream.call.cancel()
        await self.channel.close()


async def run_closed_loop(client: Client, concurrency: int, seconds: float,
                          priority_of=None) -> list[dict]:
    """`concurrency` streams back to back for `seconds`; `priority_of(rng)` picks each
    request's priority (default 0), recorded as `priority`."""
    records = []
    stop = time.monotonic() + seconds

    async def worker(index):
        rng = random.Random(index)
        while time.monotonic() < stop:
            priority = priority_of(rng) if priority_of else 0
            records.append(dict(await client.run(priority=priority), priority=priority))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return records


async def run_open_loop(client: Client, rate: float, seconds: float, actions=None,
                        count: int | None = None,
                        max_in_flight: int = 1024) -> tuple[int, list[dict], float]:
    """Poisson arrivals at `rate`/s for `seconds` (or `count` requests); returns (sent, ended,
    achieved arrival rate)."""
    records: list[dict] = []
    in_flight: set[asyncio.Task] = set()
    sent = 0
    rng = random.Random(0)
    start = time.monotonic()
    next_at = start

    def ended(task: asyncio.Task):
        in_flight.discard(task)
        records.append(task.result())

    while (count is None and time.monotonic() - start < seconds) or (count is not None
                                                                       and sent < count):
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        next_at += rng.expovariate(rate)
        action = actions(rng) if actions else "complete"
        while len(in_flight) >= max_in_flight:
            await asyncio.wait(set(in_flight), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(client.run(action))
        in_flight.add(task)
        task.add_done_callback(ended)
        sent += 1
        if sent % 1000 == 0:
            print(f"  sent {sent}, ended {len(records)}", flush=True)
    achieved = sent / max(1e-9, time.monotonic() - start)
    if in_flight:
        await asyncio.wait(set(in_flight), timeout=600)
    await asyncio.sleep(0)  # let the last done-callbacks run
    return sent, records, achieved


def outcome_counts(records):
    counts = {}
    for r in records:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return counts


def errors_of(records) -> list[str]:
    return sorted({r.get("error", "") for r in records if r["outcome"] == "error"})[:5]


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


async def warm_up(client: Client, concurrency: int, seconds: float = 5.0) -> None:
    """A fresh server's first requests pay one-time costs; they are not measured."""
    print(f"[soak] warm-up: closed loop, {concurrency} streams, {seconds:.0f} s", flush=True)
    await run_closed_loop(client, concurrency, seconds)


async def run_load_phases(args, server, sampler: RssSampler, report: dict) -> None:
    """capacity, then overload and soak as chosen; figures into `report`."""
    client = Client(server.grpc_url, args.prompt_len, args.max_tokens, args.deadline)
    sampler.client = client
    try:
        await warm_up(client, args.concurrency)
        print(f"[soak] capacity: closed loop, {args.concurrency} streams, "
              f"{args.capacity_seconds:.0f} s", flush=True)
        t0 = time.monotonic()
        capacity = await run_closed_loop(client, args.concurrency, args.capacity_seconds)
        elapsed = time.monotonic() - t0
        ok = [r for r in capacity if r["outcome"] == "output"]
        rate = len(ok) / elapsed
        if not ok:
            raise SystemExit(f"capacity phase: no request completed: {outcome_counts(capacity)} "
                             f"{capacity[:1]}")
        cap_ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        cap_server = [r["server_ttft"] for r in ok if r.get("server_ttft") is not None]
        report["capacity"] = {"requests": len(capacity), "ok": len(ok), "req_per_s": rate,
                              "ttft_p50_s": percentile(cap_ttft, 50),
                              "ttft_p99_s": percentile(cap_ttft, 99),
                              "server_ttft_p99_s": percentile(cap_server, 99)}
        warm_at = time.monotonic() + args.warmup_seconds
        report["rss"] = {}

        if args.overload_seconds > 0:
            offered = rate * args.overload_factor
            print(f"[soak] overload: {offered:.2f} req/s ({args.overload_factor}x) for "
                  f"{args.overload_seconds:.0f} s", flush=True)
            sent, records, achieved = await run_open_loop(client, offered, args.overload_seconds,
                                                          max_in_flight=args.max_in_flight)
            counts = outcome_counts(records)
            admitted = [r["ttft"] for r in records if r["outcome"] == "output" and r["ttft"]]
            server_side = [r["server_ttft"] for r in records
                           if r["outcome"] == "output" and r.get("server_ttft") is not None]
            report["overload"] = {
                "offered_req_per_s": offered, "achieved_req_per_s": achieved, "sent": sent,
                "ended": len(records), "lost": sent - len(records), "outcomes": counts,
                "ttft_p99_s": percentile(admitted, 99),
                "ttft_p99_vs_capacity": (percentile(admitted, 99)
                                         / report["capacity"]["ttft_p99_s"]),
                "server_ttft_p99_s": percentile(server_side, 99),
                "server_ttft_p99_vs_capacity": (percentile(server_side, 99)
                                                / report["capacity"]["server_ttft_p99_s"]),
                "errors": errors_of(records)}
            report["rss"]["overload"] = sampler.flatness(warm_at, time.monotonic())
            report["after_overload"] = await asyncio.to_thread(wait_idle, server.metrics_url)

        if args.soak_requests > 0:
            def soak_action(rng):
                if rng.random() >= args.cancel_fraction:
                    return "complete"
                return rng.choice(["cancelled", "disconnected"])

            soak_rate = rate * args.soak_rate_factor
            soak_at = max(warm_at, time.monotonic())
            print(f"[soak] soak: {args.soak_requests} requests at {soak_rate:.2f} req/s, "
                  f"{args.cancel_fraction:.0%} cancelled/disconnected", flush=True)
            sent, records, _ = await run_open_loop(client, soak_rate, 0, soak_action,
                                                   count=args.soak_requests,
                                                   max_in_flight=args.max_in_flight)
            idle = await asyncio.to_thread(wait_idle, server.metrics_url)
            report["soak"] = {
                "sent": sent, "ended": len(records), "lost": sent - len(records),
                "outcomes": outcome_counts(records),
                "leaked_kv_blocks": idle.get("num_used_blocks"),
                "leaked_executor_requests": sum(idle.get(k, 0) for k in (
                    "num_active_requests", "num_waiting_requests", "num_queued_requests")),
                "leaked_model_requests": idle.get("model_active_requests", 0)
                + idle.get("model_tracked_ids", 0),
                "errors": errors_of(records)}
            report["rss"]["soak"] = sampler.flatness(soak_at, time.monotonic())
        sampler.stopping.set()
        report["rss_series_mib"] = sampler.series(warm_at)
    finally:
        await client.close()


async def run_priority_phase(args, server, report: dict) -> None:
    """Closed loop over the batch with a share of high-priority requests; figures into `report`."""
    client = Client(server.grpc_url, args.prompt_len, args.max_tokens, args.deadline)
    try:
        await warm_up(client, args.concurrency)
        print(f"[soak] priority: closed loop, {args.priority_concurrency} streams, "
              f"{args.high_fraction:.0%} at priority {args.high_priority}, "
              f"{args.priority_seconds:.0f} s", flush=True)
        records = await run_closed_loop(
            client, args.priority_concurrency, args.priority_seconds,
            lambda rng: args.high_priority if rng.random() < args.high_fraction else 0)
        report["priority"] = {}
        for name, level in (("high", args.high_priority), ("low", 0)):
            mine = [r for r in records if r["priority"] == level]
            ttft = [r["ttft"] for r in mine if r["outcome"] == "output" and r["ttft"]]
            server_side = [r["server_ttft"] for r in mine
                           if r["outcome"] == "output" and r.get("server_ttft") is not None]
            report["priority"][name] = {
                "requests": len(mine), "outcomes": outcome_counts(mine),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "server_ttft_p50_s": percentile(server_side, 50)}
        high, low = report["priority"]["high"], report["priority"]["low"]
        report["priority"]["ttft_p50_high_vs_low"] = high["ttft_p50_s"] / low["ttft_p50_s"]
        report["priority"]["server_ttft_p50_high_vs_low"] = (high["server_ttft_p50_s"]
                                                             / low["server_ttft_p50_s"])
        report["priority"]["low_unfinished"] = (low["requests"]
                                                - low["outcomes"].get("output", 0))
        report["after_priority"] = await asyncio.to_thread(wait_idle, server.metrics_url)
    finally:
        await client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", help="a model repository (default: a tiny engine's)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="closed-loop streams of the capacity phase (the tiny engine's batch)")
    parser.add_argument("--capacity-seconds", type=float, default=30)
    parser.add_argument("--overload-factor", type=float, default=4.0)
    parser.add_argument("--overload-seconds", type=float, default=120)
    parser.add_argument("--soak-requests", type=int, default=3000)
    parser.add_argument("--soak-rate-factor", type=float, default=1.0,
                        help="soak arrival rate as a multiple of capacity")
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="client-side deadline per request (s)")
    parser.add_argument("--max-in-flight", type=int, default=1024,
                        help="requests in flight at most; when reached, arrivals wait (the achieved "
                             "rate is reported)")
    parser.add_argument("--priority-concurrency", type=int, default=48)
    parser.add_argument("--priority-seconds", type=float, default=60)
    parser.add_argument("--high-fraction", type=float, default=0.25)
    parser.add_argument("--high-priority", type=int, default=10)
    parser.add_argument("--max-waiting-requests", type=int, default=4,
                        help="serving.max_waiting_requests of the tiny engine's repository for "
                             "capacity, overload and soak (a quarter of the batch keeps TTFT "
                             "under overload near its value at capacity)")
    parser.add_argument("--priority-max-waiting-requests", type=int, default=None,
                        help="the same for the priority phase, which needs a queue (default: "
                             "the spec's)")
    parser.add_argument("--engine-threads", type=int, default=0,
                        help="engine_num_threads of the tiny engine's repository (0: every core; "
                             "1 leaves a core to this load generator on a small machine)")
    parser.add_argument("--warmup-seconds", type=float, default=20)
    parser.add_argument("--malloc", default="auto",
                        help="tritonserver's allocator, as forge serve --malloc")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args(argv)

    from builder.repository import RepositoryOptions, emit_repository
    from builder.serving.serve import start_tritonserver
    from builder.spec import ServingSpec

    workdir = Path(tempfile.mkdtemp(prefix="forge-soak-"))
    load_repository = priority_repository = args.repository
    if args.repository is None:
        from tests.triton_helpers import build_tiny_engine

        print("[soak] building a tiny engine", flush=True)
        engine_dir = build_tiny_engine(workdir, max_seq_len=512, num_kv_blocks=512)
        options = RepositoryOptions(stats_period_ms=100, engine_num_threads=args.engine_threads)

        def repository(name, max_waiting):
            serving = ServingSpec() if max_waiting is None else ServingSpec(
                max_waiting_requests=max_waiting)
            return emit_repository(engine_dir, workdir / name, options, serving)

        load_repository = repository("load", args.max_waiting_requests)
        priority_repository = repository("priority", args.priority_max_waiting_requests)
    report: dict = {"args": vars(args)}

    if args.overload_seconds > 0 or args.soak_requests > 0:
        print(f"[soak] starting tritonserver on {load_repository}", flush=True)
        server = start_tritonserver(load_repository, ready_timeout=600,
                                    malloc=args.malloc)
        report["allocator"] = server.allocator
        sampler = RssSampler(server.process.pid)
        try:
            sampler.start()
            asyncio.run(run_load_phases(args, server, sampler, report))
        finally:
            sampler.stopping.set()
            server.stop()
    if args.priority_seconds > 0:
        print(f"[soak] starting tritonserver on {priority_repository}", flush=True)
        server = start_tritonserver(priority_repository, ready_timeout=600,
                                    malloc=args.malloc)
        try:
            asyncio.run(run_priority_phase(args, server, report))
        finally:
            server.stop()

    rows = [("tritonserver malloc", report.get("allocator", "-"))]
    cap = report.get("capacity")
    if cap:
        rows += [
            ("capacity req/s", f"{cap['req_per_s']:.2f}"),
            ("capacity TTFT p50 / p99 (s)", f"{cap['ttft_p50_s']:.3f} / {cap['ttft_p99_s']:.3f}"),
        ]
    failed = False
    over = report.get("overload")
    if over:
        rows += [
            ("overload offered / achieved req/s", f"{over['offered_req_per_s']:.2f} / "
                                                  f"{over['achieved_req_per_s']:.2f} "
                                                  f"({over['achieved_req_per_s'] / cap['req_per_s']:.2f}x "
                                                  "capacity)"),
            ("overload sent / ended / lost",
             f"{over['sent']} / {over['ended']} / {over['lost']}"),
            ("overload outcomes", json.dumps(over["outcomes"])),
            ("overload TTFT p99 admitted (s)", f"{over['ttft_p99_s']:.3f} "
                                               f"({over['ttft_p99_vs_capacity']:.2f}x capacity)"),
            ("  server side (arrival -> first token)",
             f"{over['server_ttft_p99_s']:.3f} ({over['server_ttft_p99_vs_capacity']:.2f}x "
             f"capacity's {cap['server_ttft_p99_s']:.3f})"),
        ]
        failed = failed or bool(over["lost"]) or over["ttft_p99_vs_capacity"] > 3
    soak = report.get("soak")
    if soak:
        rows += [
            ("soak sent / ended / lost", f"{soak['sent']} / {soak['ended']} / {soak['lost']}"),
            ("soak outcomes", json.dumps(soak["outcomes"])),
            ("soak leaked KV blocks", f"{soak['leaked_kv_blocks']:.0f}"),
            ("soak leaked requests (executor / model)",
             f"{soak['leaked_executor_requests']:.0f} / {soak['leaked_model_requests']:.0f}"),
        ]
        failed = failed or bool(soak["lost"] or soak["leaked_kv_blocks"]
                                or soak["leaked_executor_requests"]
                                or soak["leaked_model_requests"])
    prio = report.get("priority")
    if prio:
        rows += [
            ("priority requests high / low", f"{prio['high']['requests']} / "
                                             f"{prio['low']['requests']}"),
            ("priority TTFT p50 high / low (s)", f"{prio['high']['ttft_p50_s']:.3f} / "
                                                 f"{prio['low']['ttft_p50_s']:.3f} "
                                                 f"({prio['ttft_p50_high_vs_low']:.2f}x)"),
            ("  server side (arrival -> first token)",
             f"{prio['high']['server_ttft_p50_s']:.3f} / {prio['low']['server_ttft_p50_s']:.3f} "
             f"({prio['server_ttft_p50_high_vs_low']:.2f}x)"),
            ("priority low-priority unfinished", f"{prio['low_unfinished']}"),
        ]
        failed = failed or bool(prio["low_unfinished"]) or prio["ttft_p50_high_vs_low"] > 1 / 3
    for phase, processes in report.get("rss", {}).items():
        for name, rss in sorted(processes.items()):
            failed = failed or rss["growth_pct"] > 5  # memory given back is no leak
            rows.append((f"RSS {phase} {name} (MiB)",
                         f"{rss['first_mib']:.1f} -> {rss['last_mib']:.1f} "
                         f"({rss['growth_pct']:+.1f}%)"))
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nJSON: {args.out}")
    if failed:
        print("FAILED: a request was lost, state leaked, a low-priority request starved, or a "
              "bound was missed (TTFT p99 under overload <= 3x capacity's, high/low TTFT p50 "
              "<= 1/3, RSS growth within 5%)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

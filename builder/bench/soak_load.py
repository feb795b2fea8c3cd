"""The soak's load and what it watches: streaming requests to the `tensorrt_llm` model over one
gRPC channel from one asyncio event loop (so a 2-core machine that also runs the server can offer
several times capacity), each request's outcome classified (output, busy, deadline, error,
cancelled, disconnected); closed loops and Poisson open loops over it; the RSS of every process
under the server, sampled beside the peaks of requests in flight."""
from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from builder.bench.serve_memory import process_tree


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

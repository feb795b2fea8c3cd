"""The load generator: runs one concurrency level of a workload against one server.

`concurrency` clients each send one request at a time (a closed loop, as a pool of users);
with `rate` set, requests additionally start no earlier than a seeded Poisson schedule (an open
loop capped at `concurrency` in flight). A level ends after `num_requests` requests, or once
`duration_s` has passed (requests in flight then finish and count).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from builder.bench.client_base import Client
from builder.bench.records import RequestRecord
from builder.bench.workloads import WorkItem


@dataclass(frozen=True)
class LevelPlan:
    concurrency: int
    num_requests: int | None = None
    duration_s: float | None = None
    rate: float | None = None  # requests/s; None sends as fast as the concurrency allows
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of requests and duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")


@dataclass
class LevelRun:
    plan: LevelPlan
    records: list[RequestRecord]
    wall_s: float


class _Dispenser:
    """Hands out request indices (and their scheduled start times) to the client threads."""

    def __init__(self, plan: LevelPlan, start: float) -> None:
        self._plan, self._start = plan, start
        self._lock = threading.Lock()
        self._next = 0
        self._rng = random.Random(f"arrivals:{plan.seed}")
        self._arrival = 0.0

    def take(self) -> tuple[int, float] | None:
        with self._lock:
            plan = self._plan
            if plan.num_requests is not None and self._next >= plan.num_requests:
                return None
            if plan.duration_s is not None and time.perf_counter() - self._start >= plan.duration_s:
                return None
            index = self._next
            self._next += 1
            if plan.rate is not None:
                self._arrival += self._rng.expovariate(plan.rate)
            return index, self._start + self._arrival


def run_level(clients: list[Client], items: list[WorkItem], plan: LevelPlan,
              on_done: Callable[[RequestRecord], None] | None = None) -> LevelRun:
    """Drive `items` (cycled) through `clients` (one thread each; len(clients) == concurrency)."""
    if len(clients) != plan.concurrency:
        raise ValueError(f"need {plan.concurrency} clients, got {len(clients)}")
    if not items:
        raise ValueError("workload has no items")
    records: list[RequestRecord] = []
    failures: list[BaseException] = []
    start = time.perf_counter()
    dispenser = _Dispenser(plan, start)

    def worker(client: Client) -> None:
        try:
            while (task := dispenser.take()) is not None:
                index, not_before = task
                wait = not_before - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                record = client.send(items[index % len(items)], index, start)
                records.append(record)  # list.append is atomic under the GIL
                if on_done is not None:
                    on_done(record)
        except BaseException as exc:  # surfaced in the caller, never lost in a thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    records.sort(key=lambda r: r.index)
    ends = [r.start + r.end for r in records if r.end is not None]
    wall = (max(ends) if ends else time.perf_counter() - start)
    return LevelRun(plan, records, wall)

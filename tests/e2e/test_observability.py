"""Prometheus metrics of the tensorrt_llm model on a real tritonserver, and the Grafana dashboard.

One server for the module. Requests with known prompt and output lengths move the histograms by
exactly what the client saw; refused and cancelled requests move the outcome counter; every
metric the dashboard in docs/ reads exists in a real scrape.
"""
import json
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from builder.client import stream_grpc
from builder.repository.emit import RepositoryOptions, emit_repository
from tests.triton_helpers import build_tiny_engine, running_tritonserver
from triton_backend.models.metrics import HISTOGRAMS, METRIC_NAMES, ExecutorMetrics, outcome_of

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$')


def parse(text: str) -> dict[tuple[str, str], float]:
    """{(name, sorted labels): value} of a Prometheus text exposition."""
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = ",".join(sorted(re.findall(r'\w+="[^"]*"', match.group(2) or "")))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def scrape(server) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        return parse(reply.read().decode())


def value(samples, name: str, **labels) -> float:
    """Sum of `name` over the samples whose labels include `labels` (model tensorrt_llm)."""
    labels.setdefault("model", "tensorrt_llm")
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(w in lab.split(",") for w in wanted))


# -- unit: the routing of observations, with a fake pb_utils ------------------------------------
class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    created: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):
        assert (buckets is not None) == (self.kind == "histogram"), self.name
        metric = FakeMetric()
        FakeFamily.created[(self.name, tuple(sorted(labels.items())))] = metric
        return metric


class FakeMetric:
    def __init__(self):
        self.values = []

    def observe(self, v):
        self.values.append(v)

    def increment(self, v):
        self.values.append(v)

    def set(self, v):
        self.values = [v]


class FakePbUtils:
    MetricFamily = FakeFamily


def test_observations_go_to_the_right_histograms():
    FakeFamily.created = {}
    metrics = ExecutorMetrics(FakePbUtils, "m", "1")
    by_name = {name: m for (name, labels), m in FakeFamily.created.items() if name in HISTOGRAMS}
    ms = 1_000_000
    metrics.observe_request(arrival_ns=0, first_token_ns=200 * ms, last_token_ns=1100 * ms,
                            final_ns=1200 * ms, num_input_tokens=7, num_output_tokens=10,
                            outcome="completed", queue_ns=50 * ms)
    assert by_name["nv_llm_time_to_first_token_seconds"].values == [0.2]
    assert by_name["nv_llm_inter_token_latency_seconds"].values == [pytest.approx(0.1)]
    assert by_name["nv_llm_e2e_request_latency_seconds"].values == [1.2]
    assert by_name["nv_llm_input_token_len"].values == [7.0]
    assert by_name["nv_llm_output_token_len"].values == [10.0]
    assert by_name["llm_forge_request_queue_time_seconds"].values == [0.05]
    # non-streamed (first == last token time): no inter-token latency; refusals: counted only
    metrics.observe_request(arrival_ns=0, first_token_ns=5 * ms, last_token_ns=5 * ms,
                            final_ns=5 * ms, num_input_tokens=3, num_output_tokens=4,
                            outcome="completed")
    metrics.observe_request(arrival_ns=0, first_token_ns=0, last_token_ns=0, final_ns=ms,
                            num_input_tokens=3, num_output_tokens=0, outcome="rejected")
    assert len(by_name["nv_llm_inter_token_latency_seconds"].values) == 1
    assert len(by_name["nv_llm_e2e_request_latency_seconds"].values) == 2
    assert len(by_name["llm_forge_request_queue_time_seconds"].values) == 1  # only when given
    outcomes = {dict(labels)["outcome"]: m.values for (name, labels), m in
                FakeFamily.created.items() if name == "llm_forge_requests_total"}
    assert outcomes["completed"] == [1.0, 1.0] and outcomes["rejected"] == [1.0]
    assert outcome_of("server busy, 9 waiting (limit 8)", None) == "rejected"
    assert outcome_of("boom", None) == "error"
    assert outcome_of(None, "cancelled") == "cancelled"
    assert outcome_of(None, "length") == "completed"


def test_gauges_are_set_only_when_their_value_changes(monkeypatch):
    # Each set is a stub -> server round trip: a publish repeats none for a value that held still.
    FakeFamily.created = {}
    sets = []
    monkeypatch.setattr(FakeMetric, "set", lambda self, v: sets.append(v) or setattr(
        self, "values", [v]))
    metrics = ExecutorMetrics(FakePbUtils, "m", "1")
    metrics.publish({"num_steps": 3, "num_waiting": 0, "note": "text"})
    assert sorted(sets) == [0.0, 3.0]
    sets.clear()
    metrics.publish({"num_steps": 3, "num_waiting": 0})
    assert sets == []
    metrics.publish({"num_steps": 4, "num_waiting": 0})
    assert sets == [4.0]
    gauge = FakeFamily.created[("llm_forge_executor_stats",
                                tuple(sorted({"model": "m", "version": "1",
                                              "stat": "num_steps"}.items())))]
    assert gauge.values == [4.0]


# -- a real server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("obs"), max_seq_len=1024)
    repo = emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))
    with running_tritonserver(repo) as running:
        yield running


def ids_request(prompt_len: int, max_tokens: int, stream: bool = True) -> dict:
    # end_id 2 (<|end|>) with min_tokens = max_tokens: every request generates exactly max_tokens
    return {"input_ids": np.array([list(range(5, 5 + prompt_len))], np.int32),
            "input_lengths": np.array([[prompt_len]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32),
            "min_tokens": np.array([[max_tokens]], np.int32),
            "streaming": np.array([[stream]])}


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    return predicate()


pytestmark_slow = pytest.mark.slow


@pytestmark_slow
def test_histograms_move_by_what_the_client_saw(server):
    before = scrape(server)
    jobs = [(3, 6, True), (9, 12, True), (4, 5, False)]
    received, spread = [], 0
    started = time.time()
    for prompt_len, max_tokens, stream in jobs:
        chunks = list(stream_grpc(server.grpc_url, "tensorrt_llm",
                                  ids_request(prompt_len, max_tokens, stream)))
        received.append(sum(c["output_ids"].size for c in chunks))
        # Inter-token latency exists for a request whose tokens came in more than one chunk
        # (a slow response thread may coalesce a short stream into one).
        spread += sum(c["output_ids"].size > 0 for c in chunks) > 1
    elapsed = time.time() - started
    assert received == [6, 12, 5]
    # The stub's metric updates reach the server beside, not before, the responses: wait until
    # the last observations of each request (time to first token, inter-token latency) are in.
    ttft_count = value(before, "nv_llm_time_to_first_token_seconds_count") + 3
    itl_count = value(before, "nv_llm_inter_token_latency_seconds_count") + spread

    def settled():
        samples = scrape(server)
        done = (value(samples, "nv_llm_time_to_first_token_seconds_count") == ttft_count
                and value(samples, "nv_llm_inter_token_latency_seconds_count") == itl_count)
        return samples if done else None

    after = wait_for(settled)
    assert after, "the three requests' observations never reached /metrics"

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("nv_llm_input_token_len_count") == 3
    assert delta("nv_llm_input_token_len_sum") == 3 + 9 + 4
    assert delta("nv_llm_output_token_len_sum") == sum(received)
    assert delta("nv_llm_e2e_request_latency_seconds_count") == 3
    assert delta("nv_llm_time_to_first_token_seconds_count") == 3
    assert spread >= 1 and delta("nv_llm_inter_token_latency_seconds_count") == spread
    ttft, e2e = (delta("nv_llm_time_to_first_token_seconds_sum"),
                 delta("nv_llm_e2e_request_latency_seconds_sum"))
    assert 0 < ttft <= e2e <= elapsed + 0.5
    assert delta("llm_forge_request_queue_time_seconds_count") == 3
    assert 0 <= delta("llm_forge_request_queue_time_seconds_sum") <= ttft
    # a bucket holds every observation at or below its bound: +Inf holds all three
    assert delta("nv_llm_output_token_len_bucket", le="+Inf") == 3
    assert delta("nv_llm_output_token_len_bucket", le="4") == 0
    assert delta("nv_llm_output_token_len_bucket", le="16") == 3
    assert delta("llm_forge_requests_total", outcome="completed") == 3


@pytestmark_slow
def test_refusals_cancellations_and_gauges(server):
    before = scrape(server)
    bad = ids_request(3, 0)
    with pytest.raises(RuntimeError, match="request_output_len"):
        list(stream_grpc(server.grpc_url, "tensorrt_llm", bad))
    chunks = stream_grpc(server.grpc_url, "tensorrt_llm", ids_request(3, 900))
    next(chunks)
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_request_metrics",
                                  request_type="active") == 1)
    samples = scrape(server)
    used = value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
    free = value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free")
    total = value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")
    assert used >= 1 and used + free == total
    chunks.close()
    after = wait_for(lambda: (s := scrape(server)) and value(
        s, "llm_forge_requests_total", outcome="cancelled") > value(
        before, "llm_forge_requests_total", outcome="cancelled") and s)
    assert value(after, "llm_forge_requests_total", outcome="invalid") - value(
        before, "llm_forge_requests_total", outcome="invalid") == 1
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_kv_cache_block_metrics",
                                  kv_cache_block_type="used") == 0)
    assert value(scrape(server), "nv_trt_llm_request_metrics", request_type="active") == 0


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    functions = {"histogram_quantile", "sum", "by", "rate", "le", "without", "avg", "max",
                 "increase"}
    names = set()
    for expr in exprs:
        stripped = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(by|without) *\([^)]*\)', "", expr)
        names |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped)
                  if w not in functions and not w.startswith("__")}
    return names


@pytestmark_slow
def test_every_dashboard_metric_exists_in_a_real_scrape(server):
    list(stream_grpc(server.grpc_url, "tensorrt_llm", ids_request(3, 4)))
    scraped = {name for name, _ in scrape(server)}
    names = dashboard_metric_names()
    missing = sorted(names - scraped)
    assert not missing, missing
    # and the dashboard covers every family the model publishes
    for family in METRIC_NAMES:
        assert any(n == family or n.startswith(family + "_") for n in names), family


@pytestmark_slow
def test_the_metrics_reader_reads_every_executor_counter_of_a_real_scrape(server):
    from builder.client.metrics_reader import scrape as read_engine_stats

    stats = read_engine_stats(server.metrics_url).of("tensorrt_llm")
    published = {re.search(r'stat="([^"]+)"', labels).group(1) for name, labels in scrape(server)
                 if name == "llm_forge_executor_stats" and 'model="tensorrt_llm"' in labels}
    assert "num_threads" in stats and stats.keys() == published
    assert stats["num_threads"] == value(scrape(server), "llm_forge_executor_stats",
                                         stat="num_threads")

"""`forge bench` measures TTFT and ITL correctly: a fake streaming model in a real tritonserver
emits tokens at known delays (first after FIRST_S, then every NEXT_S) and the load generator must
report exactly those, within tolerances generous enough for a loaded 2-core machine. Sleeping can
only overshoot, so lower bounds are tight and upper bounds loose; swapping TTFT and ITL, or
timing from the wrong clock, fails."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from builder.bench.clients import fetch_model_inputs, make_client
from builder.bench.loadgen import LevelPlan, run_level
from builder.bench.workloads import WorkItem
from triton_helpers import start_tritonserver

FIRST_S, NEXT_S = 0.4, 0.15
NUM_TOKENS = 6
MODEL = "fake_stream"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("fake_triton")
    repo = work / "repo"
    shutil.copytree(Path(__file__).parents[1] / "fake_models" / MODEL, repo / MODEL)
    config = repo / MODEL / "config.pbtxt"
    text = config.read_text().replace('"0.4"', f'"{FIRST_S}"').replace('"0.15"', f'"{NEXT_S}"')
    config.write_text(text)
    running = start_tritonserver(repo, ready_timeout=120)
    try:
        yield running
    finally:
        running.stop()


def _run(server, protocol, stream, concurrency, num_requests):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    inputs = fetch_model_inputs(url, MODEL, protocol)
    clients = [make_client(protocol, url, MODEL, inputs, fixed_output=True, timeout_s=30)
               for _ in range(concurrency)]
    items = [WorkItem(f"prompt {i}", NUM_TOKENS, stream=stream) for i in range(num_requests)]
    try:
        run = run_level(clients, items, LevelPlan(concurrency, num_requests=num_requests))
    finally:
        for client in clients:
            client.close()
    for record in run.records:
        record.count_output_tokens(None)
    return run


def _assert_timings(record):
    assert record.ok, record.error
    assert record.output_tokens == NUM_TOKENS
    assert record.output_tokens_source == "server"
    assert FIRST_S - 0.02 <= record.ttft <= FIRST_S + 0.35, record.chunk_times
    assert NEXT_S - 0.01 <= record.itl <= NEXT_S + 0.1, record.chunk_times
    expected_e2e = FIRST_S + (NUM_TOKENS - 1) * NEXT_S
    assert expected_e2e - 0.03 <= record.e2e <= expected_e2e + 0.6


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streaming_ttft_and_itl_match_the_model_delays(server, protocol):
    run = _run(server, protocol, stream=True, concurrency=1, num_requests=3)
    assert [r.index for r in run.records] == [0, 1, 2]
    for record in run.records:
        _assert_timings(record)
        assert len(record.chunk_times) == NUM_TOKENS  # one response per token


def test_concurrent_requests_overlap_and_keep_their_timings(server):
    # 8 requests over 4 slots: two waves of ~1.15 s each, not eight sequential ones.
    run = _run(server, "grpc", stream=True, concurrency=4, num_requests=8)
    for record in run.records:
        _assert_timings(record)
    one = FIRST_S + (NUM_TOKENS - 1) * NEXT_S
    assert 2 * one - 0.05 <= run.wall_s <= 2 * one + 1.5
    starts = sorted(r.start for r in run.records)
    assert starts[3] < 0.3  # the first wave starts together


def test_unstreamed_request_has_ttft_equal_to_e2e(server):
    run = _run(server, "grpc", stream=False, concurrency=1, num_requests=1)
    record = run.records[0]
    assert record.ok and record.itl is None
    assert len(record.chunk_times) == 1
    expected = FIRST_S + (NUM_TOKENS - 1) * NEXT_S
    assert expected - 0.03 <= record.ttft <= record.e2e <= expected + 0.6


def test_timeout_cancels_and_the_client_recovers(server):
    url = server.grpc_url
    inputs = fetch_model_inputs(url, MODEL, "grpc")
    client = make_client("grpc", url, MODEL, inputs, fixed_output=True, timeout_s=0.2)
    try:
        record = client.send(WorkItem("slow", NUM_TOKENS, stream=True), 0, 0.0)
        assert record.cancelled and not record.ok and "timeout" in record.error
    finally:
        client.close()
    run = _run(server, "grpc", stream=True, concurrency=1, num_requests=1)
    _assert_timings(run.records[0])

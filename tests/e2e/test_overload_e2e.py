"""Overload on a real tritonserver: admission limits ("server busy"), priorities and deadlines.

The engine runs one sequence at a time (max_batch_size 1) and a "hog" request that generates
thousands of tokens keeps it busy, so whatever arrives meanwhile waits: the counts below are
exact, and the order in which waiting requests run is the scheduler's, not a race. Nothing here
asserts a duration.
"""
import re
import threading

import numpy as np
import pytest

from builder.client import generate_http, stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.spec.build_spec import ServingSpec
from tests.e2e.test_observability import scrape, value, wait_for
from tests.triton_helpers import build_tiny_engine, running_tritonserver

pytestmark = pytest.mark.slow
MAX_WAITING_REQUESTS, MAX_WAITING_PROMPT_TOKENS = 2, 64
HOG_TOKENS = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("overload"), max_batch_size=1,
                                   max_seq_len=4096, kv_cache_num_blocks=320)
    repo = emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20),
                           ServingSpec(max_waiting_requests=MAX_WAITING_REQUESTS,
                                       max_waiting_prompt_tokens=MAX_WAITING_PROMPT_TOKENS))
    with running_tritonserver(repo) as running:
        yield running


def ids_request(prompt_len: int, max_tokens: int, **extra) -> dict:
    # min_tokens = max_tokens: exactly max_tokens are generated (no end id stops it early)
    inputs = {"input_ids": np.array([[5 + i % 50 for i in range(prompt_len)]], np.int32),
              "input_lengths": np.array([[prompt_len]], np.int32),
              "request_output_len": np.array([[max_tokens]], np.int32),
              "min_tokens": np.array([[max_tokens]], np.int32),
              "streaming": np.array([[True]])}
    for name, (number, dtype) in extra.items():
        inputs[name] = np.array([[number]], dtype)
    return inputs


class Background:
    """One streamed request on a thread: its chunks, or the error it ended with."""

    def __init__(self, server, model: str, inputs: dict, **kwargs) -> None:
        self.chunks, self.error = [], None
        self.thread = threading.Thread(target=self._run, args=(server, model, inputs, kwargs))
        self.thread.start()

    def _run(self, server, model, inputs, kwargs) -> None:
        try:
            self.chunks = list(stream_grpc(server.grpc_url, model, inputs, **kwargs))
        except RuntimeError as exc:
            self.error = str(exc)

    def result(self):
        self.thread.join(timeout=300)
        assert not self.thread.is_alive()
        return self


def start_hog(server):
    """A request that keeps the one batch slot for thousands of steps; returns its stream
    (close it to cancel the request) once it runs."""
    chunks = stream_grpc(server.grpc_url, "tensorrt_llm", ids_request(3, HOG_TOKENS))
    next(chunks)
    return chunks


def waiting(server) -> float:
    """Requests accepted and not running (`waiting` counts the executor's `queued` ones too)."""
    return value(scrape(server), "nv_trt_llm_request_metrics", request_type="waiting")


def wait_until_waiting(server, count: int) -> None:
    assert wait_for(lambda: waiting(server) == count, timeout=60), waiting(server)


def refused(server, model: str, inputs: dict) -> str:
    with pytest.raises(RuntimeError) as err:
        list(stream_grpc(server.grpc_url, model, inputs))
    return str(err.value)


def test_admission_limits_refuse_at_once_and_high_priority_runs_first(server):
    before = scrape(server)
    hog = start_hog(server)
    low = Background(server, "tensorrt_llm", ids_request(40, 2))  # 40 prompt tokens wait
    wait_until_waiting(server, 1)
    message = refused(server, "tensorrt_llm", ids_request(30, 2))
    assert message.endswith("server busy: 40 prompt tokens waiting (limit 64), this prompt adds 30")
    high = Background(server, "tensorrt_llm", ids_request(5, 2, priority=(10, np.int32)))
    wait_until_waiting(server, 2)
    # the request bound, through every entry point
    busy = f"server busy: 2 requests waiting (limit {MAX_WAITING_REQUESTS})"
    assert refused(server, "tensorrt_llm", ids_request(1, 2)).endswith(busy)
    for model in ("ensemble", "tensorrt_llm_bls"):
        assert refused(server, model, text_inputs(text_input="fox", max_tokens=2,
                                                  stream=True)).endswith(busy)
    with pytest.raises(RuntimeError, match=re.escape(busy)):
        generate_http(server.http_url, "ensemble", {"text_input": "fox", "max_tokens": 2})
    hog.close()  # the slot frees: the priority-10 request, though it came later, runs first
    low, high = low.result(), high.result()
    assert low.error is None and high.error is None  # nothing accepted is dropped
    assert sum(c["output_ids"].size for c in low.chunks) == 2
    assert sum(c["output_ids"].size for c in high.chunks) == 2
    high_done = int(high.chunks[-1]["last_token_time_ns"].reshape(-1)[0])
    low_first = int(low.chunks[0]["first_token_time_ns"].reshape(-1)[0])
    assert high_done <= low_first
    after = scrape(server)
    assert (value(after, "llm_forge_requests_total", outcome="rejected")
            - value(before, "llm_forge_requests_total", outcome="rejected")) == 5
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_kv_cache_block_metrics",
                                  kv_cache_block_type="used") == 0)


def test_deadlines_end_waiting_and_running_requests_with_the_error(server):
    before = scrape(server)
    hog = start_hog(server)
    # waiting behind the hog: the timeout_ms input, through the ensemble and the BLS
    for model in ("ensemble", "tensorrt_llm_bls"):
        waited = refused(server, model, text_inputs(text_input="fox", max_tokens=2, stream=True)
                         | {"timeout_ms": np.array([[300]], np.uint64)})
        assert re.search(r"timeout_ms: request exceeded its deadline of 300 ms "
                         r"\(waited \d+ ms\)$", waited), waited
    # Triton's own request timeout (microseconds) ends it the same way, naming `timeout`
    late = Background(server, "tensorrt_llm", ids_request(3, 2),
                      request_timeout_us=200_000).result()
    assert re.search(r"timeout: request exceeded its deadline of 200 ms \(waited \d+ ms\)$",
                     late.error), late.error
    # the BLS hands its own request timeout on to the request it makes
    late = Background(server, "tensorrt_llm_bls", text_inputs(text_input="fox", max_tokens=2,
                                                              stream=True),
                      request_timeout_us=200_000).result()
    assert re.search(r"timeout: request exceeded its deadline of 2\d\d ms \(waited \d+ ms\)$",
                     late.error), late.error
    hog.close()
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_request_metrics",
                                  request_type="active") == 0, timeout=60)
    # running: a long generation with a deadline
    ran = refused(server, "tensorrt_llm",
                  ids_request(3, HOG_TOKENS, timeout_ms=(300, np.uint64)))
    assert re.search(r"timeout_ms: request exceeded its deadline of 300 ms "
                     r"\(waited \d+ ms, ran \d+ ms\)$", ran), ran
    # running and streaming through the BLS: the stream ends with the error, it does not hang
    ran = refused(server, "tensorrt_llm_bls",
                  text_inputs(text_input="fox", max_tokens=HOG_TOKENS, min_tokens=HOG_TOKENS,
                              stream=True, timeout_ms=300))
    assert re.search(r"timeout_ms: request exceeded its deadline of 300 ms "
                     r"\(waited \d+ ms, ran \d+ ms\)$", ran), ran
    # their KV blocks are free and the server serves on
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_kv_cache_block_metrics",
                                  kv_cache_block_type="used") == 0)
    after = scrape(server)
    assert (value(after, "llm_forge_requests_total", outcome="timeout")
            - value(before, "llm_forge_requests_total", outcome="timeout")) == 6
    reply = generate_http(server.http_url, "ensemble", {"text_input": "fox", "max_tokens": 2})
    assert reply[0]["text_output"]


def test_the_soak_load_generator_counts_each_outcome_as_what_it_was(server):
    """`forge bench soak`'s figures rest on its client: pooled streams, one request at a time."""
    import asyncio

    from builder.bench.soak_load import Client

    async def run():
        client = Client(server.grpc_url, prompt_len=3, max_tokens=4, deadline=120)
        try:
            done = await client.run()
            again = await client.run()  # on the same stream
            assert len(client.idle) == 1
            cancelled = await client.run("cancelled")
            disconnected = await client.run("disconnected")
            hog = start_hog(server)
            behind = [Background(server, "tensorrt_llm", ids_request(3, 2)) for _ in range(2)]
            wait_until_waiting(server, 2)
            busy = await client.run()
            hog.close()
            assert all(b.result().error is None for b in behind)
            after_busy = await client.run()  # an error answer leaves its stream usable
            return done, again, cancelled, disconnected, busy, after_busy, len(client.idle)
        finally:
            await client.close()

    done, again, cancelled, disconnected, busy, after_busy, idle = asyncio.run(run())
    for record in (done, again, after_busy):
        assert record["outcome"] == "output" and 1 <= record["tokens"] <= 4, record
        assert 0 < record["server_ttft"] <= record["ttft"]
    assert cancelled["outcome"] == "cancelled" and cancelled["tokens"] > 0
    assert disconnected["outcome"] == "disconnected" and disconnected["tokens"] > 0
    assert busy["outcome"] == "busy", busy
    assert busy["error"].endswith(f"server busy: 2 requests waiting (limit "
                                  f"{MAX_WAITING_REQUESTS})")
    assert idle == 1  # cancelled and disconnected streams were dropped, not pooled
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_kv_cache_block_metrics",
                                  kv_cache_block_type="used") == 0)


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once(server, model):
    """Its client gives up before it ever runs: it must not keep its place (and its admission
    count) until the batch drains. The hog keeps running throughout, so only the cancellation
    can take the waiting request out. Not the ensemble: Triton 2.51 does not pass an ensemble's
    cancellation to its running tensorrt_llm step (docs/triton-contract.md)."""
    from builder.client.grpc_stream import GrpcStream, infer_inputs

    hog = start_hog(server)
    inputs = (ids_request(3, 2) if model == "tensorrt_llm"
              else text_inputs(text_input="fox", max_tokens=2, stream=True))
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(model, infer_inputs(inputs), request_id="given-up")
        wait_until_waiting(server, 1)
        stream.close(cancel=True)
        assert wait_for(lambda: waiting(server) == 0, timeout=10), waiting(server)
        assert value(scrape(server), "nv_trt_llm_request_metrics", request_type="active") == 1
    finally:
        hog.close()
    assert wait_for(lambda: value(scrape(server), "nv_trt_llm_request_metrics",
                                  request_type="active") == 0, timeout=60)

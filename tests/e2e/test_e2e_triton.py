"""End to end on a real tritonserver: the emitted repository of a tiny engine, on loopback.

One server for the whole module, its engine with prefix caching and prompt-lookup speculation.
Greedy text must be identical on every path (gRPC streaming on ensemble and BLS, HTTP
non-streaming, /generate, /generate_stream) and equal to `forge generate`; 16 concurrent streams
get exactly their sequential text while sharing executor steps; a cancelled stream frees its KV
blocks; bad input is refused naming the field; a shared prefix is reused and drafts verified,
reported per request and on /metrics, with the text of the engine without either.
"""
import json
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from builder.client import decode_text, generate_http, stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
from tests.triton_helpers import build_tiny_engine, running_tritonserver
from triton_backend.engine.faults import FAULT_FILE_ENV, inject

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"


# Every test here runs with prefix caching (on by default) and prompt-lookup speculation, which
# must leave every text unchanged.
SPECULATIVE = {"mode": "ngram", "num_draft_tokens": 4, "prompt_lookup_min": 1,
               "disable_by_batch_size": 16}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("e2e"), max_seq_len=1024, max_input_len=256,
                             speculative=SPECULATIVE)


@pytest.fixture(scope="module")
def fault_file(engine_dir):
    """Writing a fault name here injects it into the served engine's next step (faults.py)."""
    return engine_dir.parent / "fault"


@pytest.fixture(scope="module")
def server(engine_dir, fault_file):
    repo = emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))
    old = os.environ.get(FAULT_FILE_ENV)
    os.environ[FAULT_FILE_ENV] = str(fault_file)  # inherited by the server and its engine
    try:
        with running_tritonserver(repo) as running:
            yield running
    finally:
        if old is None:
            os.environ.pop(FAULT_FILE_ENV, None)
        else:
            os.environ[FAULT_FILE_ENV] = old


def metrics(server) -> dict[str, float]:
    """llm_forge_executor_stats{stat=...} of the tensorrt_llm model, from /metrics."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'llm_forge_executor_stats\{[^}]*stat="(\w+)"[^}]*\} ([0-9.e+-]+)'
    return {name: float(value) for name, value in re.findall(pattern, text)}


def streamed_text(server, model, stream=True, **inputs) -> str:
    chunks = list(stream_grpc(server.grpc_url, model, text_inputs(stream=stream, **inputs)))
    assert stream or len(chunks) == 1
    return "".join(decode_text(chunk) for chunk in chunks)


def grpc_request(server, model, inputs) -> list:
    return list(stream_grpc(server.grpc_url, model, inputs))


def forge_generate_text(engine_dir, prompt, max_tokens) -> str:
    from click.testing import CliRunner

    from builder.cli.engine import generate_command

    result = CliRunner().invoke(generate_command, ["--engine", str(engine_dir), "--prompt", prompt,
                                                   "--max-tokens", str(max_tokens), "--raw",
                                                   "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])["text"]


def test_the_engine_runs_in_its_own_process_with_every_core_and_the_kernels(server):
    """What `forge serve` reports: threads and kernels, read back from /metrics."""
    from builder.serving.serve import engine_report
    from triton_backend.engine.cpu_budget import available_cores

    stats = metrics(server)
    cores = available_cores()
    assert stats["num_threads"] == cores and stats["cpp_kernels"] == 1
    assert stats["engine_pid"] not in (0, os.getpid(), server.process.pid)
    assert engine_report(server.metrics_url).startswith(f"engine: {cores} torch threads")


def test_greedy_text_is_identical_on_every_path(server, engine_dir):
    texts = {}
    for model in ("ensemble", "tensorrt_llm_bls"):
        texts[f"grpc-stream/{model}"] = streamed_text(server, model, text_input=PROMPT,
                                                      max_tokens=48)
        texts[f"grpc/{model}"] = streamed_text(server, model, stream=False, text_input=PROMPT,
                                               max_tokens=48)
        replies = generate_http(server.http_url, model, {"text_input": PROMPT, "max_tokens": 48})
        assert len(replies) == 1  # /generate on the decoupled model: exactly one response
        texts[f"generate/{model}"] = replies[0]["text_output"]
        events = generate_http(server.http_url, model,
                               {"text_input": PROMPT, "max_tokens": 48, "stream": True}, True)
        # How many events is timing: responses that wait together are merged (coalesce), and on
        # a busy machine a short reply of the tiny engine can arrive as one.
        assert events and events[-1]["finish_reason"] in ("length", "end_id")
        assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
        texts[f"generate_stream/{model}"] = "".join(e["text_output"] for e in events)
    texts["forge generate"] = forge_generate_text(engine_dir, PROMPT, 48)
    assert len(set(texts.values())) == 1, texts
    assert texts["forge generate"]


def test_sixteen_concurrent_streams_get_their_sequential_text(server):
    jobs = [(f"{PROMPT} {i} " + "over the lazy dog " * (i % 4), 8 + 5 * i) for i in range(16)]
    sequential = [generate_http(server.http_url, "ensemble",
                                {"text_input": p, "max_tokens": n})[0]["text_output"]
                  for p, n in jobs]
    before = metrics(server)
    with ThreadPoolExecutor(16) as pool:
        models = ["ensemble", "tensorrt_llm_bls"]
        futures = [pool.submit(streamed_text, server, models[i % 2], text_input=p, max_tokens=n)
                   for i, (p, n) in enumerate(jobs)]
        concurrent = [f.result(timeout=300) for f in futures]
    assert concurrent == sequential
    time.sleep(0.1)
    after = metrics(server)
    assert after["num_steps"] > before["num_steps"]
    assert after["max_num_seqs_in_step"] >= 4  # steps held several sequences at once


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_cancel_mid_stream_frees_blocks_and_keeps_serving(server, model):
    chunks = stream_grpc(server.grpc_url, model,
                         text_inputs(text_input=PROMPT, max_tokens=900, stream=True))
    received = 0
    for _ in chunks:
        received += 1
        if received == 5:
            break
    deadline = time.monotonic() + 2  # counters are published every stats_period_ms
    while metrics(server)["num_used_blocks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(server)["num_used_blocks"] > 0  # the sequence still holds its blocks
    chunks.close()  # stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = metrics(server)
        if stats["num_used_blocks"] == 0 and stats["num_active_requests"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_used_blocks"] == 0 and stats["num_active_requests"] == 0, stats
    assert streamed_text(server, model, text_input=PROMPT, max_tokens=8)


def test_stop_request_with_the_same_id_cancels_the_running_one(server):
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32),
              "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[900]], np.int32),
              "streaming": np.array([[True]])}
    chunks = stream_grpc(server.grpc_url, "tensorrt_llm", inputs, request_id="req-42")
    next(chunks)
    stop = {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[1]], np.int32),
            "request_output_len": np.array([[1]], np.int32), "stop": np.array([[True]])}
    list(stream_grpc(server.grpc_url, "tensorrt_llm", stop, request_id="req-42"))
    reasons = [c["finish_reason"].reshape(-1)[0] for c in chunks]
    assert reasons[-1] == b"cancelled"


def _end(stream) -> tuple[bytes, int]:
    """(finish reason, output tokens) of a stream: (first chunk, the rest), as `start` gives it.
    The first chunk may carry several tokens (responses that wait together are merged)."""
    first, rest = stream
    chunks = [first, *rest]
    return (chunks[-1]["finish_reason"].reshape(-1)[0],
            sum(c["output_ids"].size for c in chunks))


def test_stop_by_id_cancels_only_a_request_of_the_same_client(server):
    """Two clients use the same request id: a `stop` ends only the request of its own client
    (told apart by the forwarded `x-llm-forge-client` / `authorization` headers)."""
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32),
              "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[400]], np.int32),
              "streaming": np.array([[True]])}
    stop = {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[1]], np.int32),
            "request_output_len": np.array([[1]], np.int32), "stop": np.array([[True]])}
    mallory = {"x-llm-forge-client": "mallory"}
    alice = {"authorization": "Bearer alice-token"}

    def start(headers):
        chunks = stream_grpc(server.grpc_url, "tensorrt_llm", inputs, request_id="shared-id",
                             headers=headers)
        return next(chunks), chunks

    def send_stop(headers):
        list(stream_grpc(server.grpc_url, "tensorrt_llm", stop, request_id="shared-id",
                         headers=headers))

    # A request may finish before a stop arrives; a run where Mallory's own stop came too late
    # shows nothing about scoping, so such runs are repeated (a few at most).
    for _ in range(4):
        # Mallory's request first: an id-only lookup would find Alice's, registered last.
        mallorys, alices = start(mallory), start(alice)
        for headers in (None, {"x-llm-forge-client": "alice"}, mallory):  # the last is hers
            send_stop(headers)
        mallory_end, alice_end = _end(mallorys), _end(alices)
        assert alice_end == (b"length", 400), (mallory_end, alice_end)  # no stop reached hers
        if mallory_end[0] == b"cancelled":
            break
    else:
        pytest.fail("every request finished before its stop arrived")
    for _ in range(4):  # Alice's own stop ends hers
        alices = start(alice)
        send_stop(alice)
        if _end(alices)[0] == b"cancelled":
            break
    else:
        pytest.fail("Alice's stop never ended her request")


BAD_INPUTS = [
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": PROMPT, "max_tokens": -5}, "max_tokens must be >= 1"),
    ({"text_input": PROMPT, "max_tokens": 5000}, "max_seq_len 1024"),
    ({"text_input": "fox " * 400, "max_tokens": 8}, "max_input_len 256"),
    ({"text_input": PROMPT, "max_tokens": 8, "beam_width": 2}, "beam_width must be 1"),
    ({"text_input": b"caf\xc3 \xff", "max_tokens": 8}, "text_input is not valid UTF-8"),
    ({"text_input": PROMPT, "max_tokens": 8, "top_p": 0.0}, "top_p"),
]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_bad_input_is_refused_naming_the_field_and_the_server_stays_healthy(server, model):
    for values, message in BAD_INPUTS:
        for stream in (False, True):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                grpc_request(server, model, text_inputs(stream=stream, **values))
    wrong_dtype = text_inputs(text_input=PROMPT)
    wrong_dtype["max_tokens"] = np.array([[8.0]], dtype=np.float32)
    with pytest.raises(RuntimeError, match="max_tokens"):
        grpc_request(server, model, wrong_dtype)
    with pytest.raises(RuntimeError, match="max_tokens"):  # over HTTP too
        generate_http(server.http_url, model, {"text_input": PROMPT, "max_tokens": 0})
    # text_input is declared optional (Triton 2.51 checks required inputs by count only, and an
    # ensemble whose first step cannot run answered nothing): our models name it, every protocol.
    with pytest.raises(RuntimeError, match="text_input is required"):
        generate_http(server.http_url, model, {"max_tokens": 8})
    for stream in (False, True):
        with pytest.raises(RuntimeError, match="text_input is required"):
            grpc_request(server, model, text_inputs(max_tokens=8, stream=stream))
    assert server.is_ready()
    assert streamed_text(server, model, text_input=PROMPT, max_tokens=8)


# -- prefix caching and speculative decoding ------------------------------------------------
SYSTEM = "You are a helpful assistant. The quick brown fox jumps over the lazy dog. " * 3


def _generate(server, model, prompt, max_tokens, stream=True):
    chunks = list(stream_grpc(server.grpc_url, model, text_inputs(
        text_input=prompt, max_tokens=max_tokens, stream=stream, return_perf_metrics=True)))
    return "".join(decode_text(c) for c in chunks), chunks[-1]


def _offline_text(engine_dir, prompt, max_tokens) -> str:
    """The engine in-process with both features off: the reference text."""
    from transformers import AutoTokenizer

    from triton_backend.engine import Request
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate

    tokenizer = AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"))
    engine = LLMEngine(engine_dir, enable_prefix_caching=False, enable_speculative_decoding=False)
    ids = tokenizer.encode(prompt)
    out = generate(engine, [Request(ids, max_tokens)])[0].output_ids
    return tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_shared_prefix_is_reused_and_reported_per_request(server, engine_dir, model):
    before = metrics(server)
    texts, lasts = [], []
    for question in ("What is a fox?", "Who is lazy?"):
        prompt = f"{model}: {SYSTEM}{question}"  # nothing shared with the other model's test
        text, last = _generate(server, model, prompt, 24)
        assert text == _offline_text(engine_dir, prompt, 24)
        texts.append(text)
        lasts.append(last)
    reused = [int(last["kv_cache_reused_blocks"].reshape(-1)[0]) for last in lasts]
    total = [int(last["kv_cache_alloc_total_blocks"].reshape(-1)[0]) for last in lasts]
    assert reused[0] == 0 and reused[1] >= 3 and total[1] > reused[1]
    after = metrics(server)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 48
    assert after["prefix_cache_enabled"] == 1 and after["num_cached_blocks"] >= 3


def test_speculation_is_reported_and_leaves_greedy_text_unchanged(server, engine_dir):
    prompt = "over the lazy dog " * 12
    text, last = _generate(server, "ensemble", prompt, 48, stream=False)
    assert text == _offline_text(engine_dir, prompt, 48)
    drafts = int(last["total_draft_tokens"].reshape(-1)[0])
    accepted = int(last["total_accepted_draft_tokens"].reshape(-1)[0])
    assert drafts > 0 and 0 <= accepted <= drafts
    assert abs(float(last["acceptance_rate"].reshape(-1)[0]) - accepted / drafts) < 1e-6
    stats = metrics(server)
    assert stats["spec_enabled"] == 1 and stats["spec_num_draft_tokens"] >= drafts


# Probes from review: each used to kill the engine loop for every client, or to slow every stream.
REVIEW_PROBES = [
    ({"temperature": 1e-38}, "temperature must be 0 (greedy) or within [0.01, 100.0]"),
    ({"end_id": 10**6, "min_tokens": 2}, "end_id must be a token id in [0, "),
    ({"repetition_penalty": 1e-38}, "repetition_penalty must be >= 0.01"),
    ({"frequency_penalty": -3e38}, "frequency_penalty must be >= -100.0"),
    ({"stop_words": ["x"] * 50_000}, "stop_words has 50000 entries, over the limit of 256"),
    ({"bad_words": ["y"] * 300}, "bad_words has 300 entries, over the limit of 256"),
]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_review_probes_are_refused_and_the_next_request_is_served(server, model):
    for values, message in REVIEW_PROBES:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            grpc_request(server, model, text_inputs(text_input=PROMPT, max_tokens=8, **values))
        assert server.is_ready()
    with pytest.raises(RuntimeError, match="text_input has 52428800 characters, over the limit"):
        generate_http(server.http_url, model, {"text_input": "a" * (50 << 20), "max_tokens": 8})
    assert server.is_ready()
    assert streamed_text(server, model, text_input=PROMPT, max_tokens=8)


def test_a_failing_engine_step_fails_its_requests_and_the_server_goes_on(server, fault_file):
    inject(fault_file, "oom:injected out of memory")
    with pytest.raises(RuntimeError, match="the engine step failed: MemoryError: injected out of "
                                           "memory"):
        grpc_request(server, "ensemble", text_inputs(text_input=PROMPT, max_tokens=16,
                                                     stream=True))
    assert not fault_file.exists()
    assert server.is_ready()
    assert streamed_text(server, "ensemble", text_input=PROMPT, max_tokens=8)
    assert metrics(server).get("num_failed_steps") == 1


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_step_failing_in_the_middle_of_a_stream_ends_it_with_the_error(server, fault_file,
                                                                         model):
    """The fault strikes after the stream has sent text: the client still gets the step's error
    (not a hang, not a silent end), and the next request is served."""
    chunks = stream_grpc(server.grpc_url, model, text_inputs(text_input=PROMPT, max_tokens=64,
                                                               stream=True), timeout=60)
    assert decode_text(next(chunks)) is not None
    inject(fault_file, "step:injected mid-stream")
    with pytest.raises(RuntimeError, match="the engine step failed: InjectedFault: injected "
                                           "mid-stream"):
        for _ in range(64):
            next(chunks)
    assert not fault_file.exists()
    assert server.is_ready()
    assert streamed_text(server, model, text_input=PROMPT, max_tokens=8)

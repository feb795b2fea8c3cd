"""A frozen engine behind a real tritonserver: detected, its streams ended, restarted in place.

8 gRPC streams on the ensemble, then SIGSTOP of the engine process (its pid from /metrics): within
the issue's 10 s every stream has ended with an error naming the freeze, within its 30 s a new
request is answered as before the freeze, the KV blocks and active requests on /metrics return
to 0, and forge serve's probe is answered ENGINE_RESTARTING while the new engine starts.

The measured times are printed (run with -s), never asserted beyond the issue's bounds. The
engine runs the pure-torch paths: the watchdog does not depend on the kernels.
"""
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from builder.client import generate_http, stream_grpc, text_inputs
from builder.client.metrics_reader import scrape
from builder.repository.emit import RepositoryOptions, emit_repository
from tests.triton_helpers import build_tiny_engine, running_tritonserver
from triton_backend.models.serving_control import PROBE_REQUEST_ID, STOP_REQUEST_INPUTS

pytestmark = pytest.mark.slow
STREAMS = 8
DETECTION_BOUND_SECONDS = 10.0  # the issue's: every stream ends within 10 s of the freeze
SERVING_BOUND_SECONDS = 30.0    # the issue's: a new request is answered within 30 s
RESTARTING = "tensorrt_llm: the engine is restarting ("


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    old = os.environ.get("LLM_FORGE_KERNELS")
    os.environ["LLM_FORGE_KERNELS"] = "torch"  # inherited by the server and its engines
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("frozen"), max_seq_len=1024,
                                   max_input_len=256)
    repository = emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                                 RepositoryOptions(stats_period_ms=20))
    try:
        with running_tritonserver(repository) as running:
            yield running
    finally:
        if old is None:
            os.environ.pop("LLM_FORGE_KERNELS", None)
        else:
            os.environ["LLM_FORGE_KERNELS"] = old


def _engine_stats(server) -> dict[str, float]:
    return scrape(server.metrics_url).of("tensorrt_llm")


def _probe(server) -> str:
    """forge serve's health probe, as it sends it: "" for an empty answer, else the error."""
    body = {"id": PROBE_REQUEST_ID, **{k: [v] for k, v in STOP_REQUEST_INPUTS.items()}}
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/tensorrt_llm/generate",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
            return ""
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}").get("error", f"HTTP {exc.code}")
    except OSError as exc:
        return f"no answer: {exc}"


class Stream(threading.Thread):
    """One long streaming request on the ensemble, recording how it went."""

    def __init__(self, server, index: int) -> None:
        super().__init__(daemon=True)
        self.server, self.index = server, index
        self.started = threading.Event()
        self.error: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        inputs = text_inputs(text_input=f"The quick brown fox {self.index}", max_tokens=900,
                             stream=True, min_tokens=900)
        try:
            for _ in stream_grpc(self.server.grpc_url, "ensemble", inputs, timeout=120):
                self.started.set()
        except RuntimeError as exc:
            self.error = str(exc)
        self.ended_at = time.monotonic()


def _probe_until(server, stop: threading.Event, answers: list[str]) -> None:
    while not stop.is_set():
        answers.append(_probe(server))
        time.sleep(0.1)


def test_a_stopped_engine_ends_every_stream_and_serves_again(server):
    question = {"text_input": "The quick", "max_tokens": 8}
    expected = generate_http(server.http_url, "ensemble", question)[0]["text_output"]
    assert _probe(server) == ""
    pid = int(_engine_stats(server)["engine_pid"])
    streams = [Stream(server, i) for i in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120), f"stream {stream.index} got nothing"
    answers: list[str] = []
    probing = threading.Event()
    prober = threading.Thread(target=_probe_until, args=(server, probing, answers), daemon=True)
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        prober.start()
        for stream in streams:
            stream.join(timeout=60)
        ended = max(stream.ended_at or float("inf") for stream in streams) - stopped
        for stream in streams:
            assert stream.error is not None and "made no progress for" in stream.error, \
                stream.error
        assert ended < DETECTION_BOUND_SECONDS, f"the streams ended {ended:.1f} s after SIGSTOP"
        answer = generate_http(server.http_url, "ensemble", question, timeout=300)[0]
        served = time.monotonic() - stopped
        assert answer["text_output"] == expected
    finally:
        probing.set()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    prober.join(timeout=30)
    assert any(answer.startswith(RESTARTING) and "made no progress" in answer
               for answer in answers), answers
    assert _probe(server) == ""  # running again
    deadline = time.monotonic() + 30
    while True:
        stats = _engine_stats(server)
        idle = (stats["num_used_blocks"], stats["num_active_requests"],
                stats["model_active_requests"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (stats["num_used_blocks"], stats["num_active_requests"],
            stats["model_active_requests"]) == (0, 0, 0), stats
    assert stats["num_engine_freezes"] == 1 and int(stats["engine_pid"]) != pid
    restarting = [a for a in answers if a.startswith(RESTARTING)]
    print(f"\nSIGSTOP under {STREAMS} streams: all ended {ended:.1f} s after it, served again "
          f"{served:.1f} s after it; {len(restarting)} of {len(answers)} probes answered "
          f"{restarting[0]!r}")
    # Last, so a slow restart on a crowded machine still shows every check above.
    assert served < SERVING_BOUND_SECONDS, f"served again {served:.1f} s after SIGSTOP"

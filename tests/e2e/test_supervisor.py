"""`forge serve`'s supervisor and drain.

Unit tests against a fake Triton (the probe's verdicts, reload, giving up), then a real
tritonserver: a killed `tensorrt_llm` stub and an engine down for good make the server not ready
and are reloaded without a manual step (the ensemble and the BLS answer again); past the reload
limit the server stays not ready. Then `forge serve` itself as a subprocess: SIGTERM during 16
streams drains them and exits 0; a killed tritonserver makes it exit 1; streams on the ensemble
that a client cancels (gRPC) or cuts (HTTP) stop in the engine, and the server then stops with
nothing in flight.

The measured times are printed (run with -s to see them), never asserted beyond the bounds the
acceptance states. The engine runs with the pure-torch kernels here: supervision does not depend
on them, and engine restarts stay quick on a busy machine.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from builder.client import decode_text, generate_http, stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.serve import free_port, http_ok
from builder.serving.drain import active_requests
from builder.serving.supervisor import (NOT_READY_MODEL, Supervisor, control_request,
                                        probe_model, stop_supervisors, supervised_models)
from tests.triton_helpers import (ForgeServe, build_tiny_engine, children, cmdline, engine_pid,
                                  running_tritonserver)
from triton_backend.models.serving_control import (CONTROL_TOKEN_ENV, DRAIN_REFUSED,
                                                   DRAIN_REQUEST_ID, PROBE_REQUEST_ID,
                                                   drain_request_id, is_drain_request)

STUB_DEAD = "Stub process 'tensorrt_llm_0_0' is not healthy."


# -- a fake Triton for the supervisor's decisions ---------------------------------------------
class FakeTriton:
    """Answers the probe with `self.probe` ((status, body)); records repository calls."""

    def __init__(self):
        self.probe = (200, {"model_name": "tensorrt_llm"})
        self.loads: list[tuple[int, dict]] = []  # answers to the next loads (then 200)
        self.probe_after_load: tuple[int, dict] | None = None  # the probe's, after a load
        self.calls: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.calls.append((self.path, body))
                probed = self.path.endswith(("/generate", "/infer"))
                status, reply = fake.probe if probed else (200, {})
                if self.path.endswith("/load") and fake.loads:
                    status, reply = fake.loads.pop(0)
                if self.path.endswith("tensorrt_llm/load") and fake.probe_after_load:
                    fake.probe, fake.probe_after_load = fake.probe_after_load, None
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def repository_calls(self) -> list[str]:
        return [path.split("/v2/repository/models/")[1] for path, _ in self.calls
                if "/repository/" in path]

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def fake_triton():
    fake = FakeTriton()
    yield fake
    fake.close()


def test_probe_tells_serving_from_broken_from_inconclusive(fake_triton):
    assert probe_model(fake_triton.url).ok is True
    path, body = fake_triton.calls[-1]
    assert path == "/v2/models/tensorrt_llm/generate"
    assert body["id"] == PROBE_REQUEST_ID and body["stop"] == [True]
    fake_triton.probe = (400, {"error": STUB_DEAD})
    assert probe_model(fake_triton.url) == probe_model(fake_triton.url)
    assert probe_model(fake_triton.url).ok is False
    fake_triton.probe = (400, {"error": "tensorrt_llm: the engine is down (2 crashes)"})
    assert probe_model(fake_triton.url).ok is False
    fake_triton.probe = (400, {"error": "Exceeds maximum queue size"})  # busy, not broken
    result = probe_model(fake_triton.url)
    assert result.ok is None and result.message == "Exceeds maximum queue size"
    assert probe_model(f"127.0.0.1:{free_port()}").ok is None  # nobody listening


def test_the_other_models_are_asked_what_their_own_code_answers(fake_triton, tmp_path):
    fake_triton.probe = (200, {"model_name": "preprocessing"})
    assert probe_model(fake_triton.url, "preprocessing").ok is True
    path, body = fake_triton.calls[-1]
    assert path == "/v2/models/preprocessing/infer"
    assert [i["name"] for i in body["inputs"]] == ["QUERY", "REQUEST_OUTPUT_LEN"]
    assert probe_model(fake_triton.url, "postprocessing").ok is True
    assert fake_triton.calls[-1][0] == "/v2/models/postprocessing/infer"
    # the BLS refuses an empty text at once, without generating: its stub is alive
    fake_triton.probe = (400, {"error": "text_input must not be empty"})
    assert probe_model(fake_triton.url, "tensorrt_llm_bls").ok is True
    assert fake_triton.calls[-1] == ("/v2/models/tensorrt_llm_bls/generate",
                                     {"text_input": "", "max_tokens": 1})
    assert probe_model(fake_triton.url, "preprocessing").ok is None  # says nothing of its stub
    fake_triton.probe = (400, {"error": "Stub process 'preprocessing_0_0' is not healthy."})
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert probe_model(fake_triton.url, model).ok is False
    # which models a repository has for the supervisor: our Python models only
    for model, backend in [("preprocessing", "python"), ("tensorrt_llm", "tensorrtllm"),
                           ("ensemble", None), ("postprocessing", "python")]:
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(
            f'name: "{model}"\n' + (f'backend: "{backend}"\n' if backend else
                                    'platform: "ensemble"\n'))
    assert supervised_models(tmp_path) == ["preprocessing", "postprocessing"]


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_failed_probe_unloads_and_reloads_until_the_limit(fake_triton):
    lines: list[str] = []
    supervisor = Supervisor(fake_triton.url, period=0.01, max_reloads=1, report=lines.append)
    supervisor.start()
    try:
        time.sleep(0.1)
        assert fake_triton.repository_calls() == []  # healthy: probes only
        fake_triton.probe = (400, {"error": STUB_DEAD})
        assert _wait(supervisor.gave_up.is_set, 10)
    finally:
        supervisor.stop()
    assert fake_triton.repository_calls() == ["tensorrt_llm/unload", "tensorrt_llm/load",
                                              "tensorrt_llm/unload", f"{NOT_READY_MODEL}/load"]
    assert lines[0].startswith(f"supervisor: tensorrt_llm cannot serve ({STUB_DEAD}); unloading")
    assert "tensorrt_llm reloaded, ready again after" in lines[1]
    why = ("forge serve stopped reloading tensorrt_llm: 2 failures within 300 s, reload limit 1; "
           f"last failure: {STUB_DEAD}")
    assert lines[-1] == (f"supervisor: {why}; tensorrt_llm stays unloaded and the server not "
                         f"ready until forge serve is restarted")
    stand_in = fake_triton.calls[-1][1]["parameters"]
    assert json.loads(stand_in["config"]) == {"backend": "python", "max_batch_size": 0}
    import base64

    assert repr(why) in base64.b64decode(stand_in["file:1/model.py"]).decode()


def test_a_supervisor_halted_while_it_unloads_does_not_reload(fake_triton):
    """forge serve halts its supervisors before the drain: one that was already recovering a
    model must not load it again into a stopping server."""
    supervisor = Supervisor(fake_triton.url, period=0.01, max_reloads=3,
                            report=lambda line: supervisor.halt())  # halted at its first report
    fake_triton.probe = (400, {"error": STUB_DEAD})
    supervisor.start()
    supervisor.join(10)
    assert not supervisor.is_alive()
    assert fake_triton.repository_calls() == ["tensorrt_llm/unload"]


class _Stoppable:
    """A stand-in supervisor that records, when it is joined, which of its peers were halted."""

    def __init__(self, model: str, peers: list, busy: bool = False):
        self.model, self.peers, self.busy = model, peers, busy
        self.halted, self.alive, self.seen_halted = False, True, None

    def halt(self):
        self.halted = True

    def join(self, timeout):
        self.seen_halted = [peer.halted for peer in self.peers]
        self.alive = self.busy  # a busy one is still inside its probe when the wait ends

    def is_alive(self):
        return self.alive


def test_supervisors_are_all_halted_before_any_is_waited_for():
    """Stopped one after the other, each maybe inside a probe of a model busy with streams, they
    held the drain up by the sum of their waits (forge serve once did not reach the drain)."""
    peers: list = []
    peers += [_Stoppable(model, peers, busy=model == "postprocessing")
              for model in ("tensorrt_llm", "preprocessing", "postprocessing")]
    lines: list[str] = []
    stop_supervisors(peers, timeout=1.0, report=lines.append)
    assert [peer.seen_halted for peer in peers] == [[True, True, True]] * 3
    assert lines == ["supervisor: still waiting for a probe of postprocessing; draining anyway"]


def test_inconclusive_probes_count_only_after_hung_seconds(fake_triton):
    lines: list[str] = []
    supervisor = Supervisor(fake_triton.url, period=0.01, hung_seconds=0.5, max_reloads=0,
                            report=lines.append)
    fake_triton.probe = (400, {"error": "Exceeds maximum queue size"})
    started = time.monotonic()
    supervisor.start()
    try:
        assert _wait(supervisor.gave_up.is_set, 10)
    finally:
        supervisor.stop()
    assert time.monotonic() - started >= 0.5
    assert ("no conclusive answer to the health probe for 0.5 s (last: Exceeds maximum queue "
            "size)") in lines[0]


def test_a_failed_reload_is_retried_at_the_next_probe_not_after_hung_seconds(fake_triton):
    """The engine killed again while the reload starts it: the load fails and Triton answers
    the probe "unknown model" from then on. That is no inconclusive answer: the supervisor made
    the model unavailable itself, so it reloads again at once, within its reload limit."""
    lines: list[str] = []
    supervisor = Supervisor(fake_triton.url, period=0.05, hung_seconds=30.0, max_reloads=3,
                            report=lines.append)
    fake_triton.loads = [(400, {"error": "load failed for model 'tensorrt_llm': version 1 is at "
                                         "UNAVAILABLE state: Internal: EngineProcessError"})]
    fake_triton.probe = (400, {"error": STUB_DEAD})
    fake_triton.probe_after_load = (400, {"error": "Request for unknown model: 'tensorrt_llm' "
                                                   "has no available versions"})
    supervisor.start()
    try:
        assert _wait(lambda: any("reloaded, ready again" in line for line in lines), 5), lines
        fake_triton.probe = (200, {"model_name": "tensorrt_llm"})
    finally:
        supervisor.stop()
    assert fake_triton.repository_calls()[:4] == ["tensorrt_llm/unload", "tensorrt_llm/load",
                                                  "tensorrt_llm/unload", "tensorrt_llm/load"]
    assert any("cannot serve (the last reload failed (load failed for model 'tensorrt_llm'"
               in line for line in lines), lines
    assert not supervisor.gave_up.is_set()


def test_active_requests_reads_the_models_counter(tmp_path):
    text = ('llm_forge_executor_stats{model="tensorrt_llm",stat="model_active_requests",'
            'version="1"} 3\nllm_forge_executor_stats{model="tensorrt_llm",stat="num_steps",'
            'version="1"} 9\n')
    fake = tmp_path / "metrics"
    fake.write_text(text)
    assert active_requests(fake.as_uri()) == 3
    fake.write_text(text.replace("} 3", "} 0"))
    assert active_requests(fake.as_uri()) == 0
    assert active_requests(fake.as_uri(), model="other") is None


# -- a real tritonserver ------------------------------------------------------------------------
def _child_with(pid: int, text: str) -> int | None:
    matches = [child for child in children(pid) if text in cmdline(child)]
    return matches[0] if matches else None


def _ready(server) -> bool:
    return http_ok(f"http://{server.http_url}/v2/health/ready")


def _answers(server, model: str) -> bool:
    try:
        events = generate_http(server.http_url, model, {"text_input": "The quick", "max_tokens": 4},
                               timeout=30)
    except Exception:
        return False
    return events[0]["num_output_tokens"] == 4


def _poll(predicate, timeout: float) -> float | None:
    """Seconds until `predicate()` held, polling every 0.1 s; None if not within `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.1)
    return None


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("supervised"), max_seq_len=1024,
                                   max_input_len=256)
    return emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))


@pytest.fixture(scope="module")
def torch_kernels():
    old = os.environ.get("LLM_FORGE_KERNELS")
    os.environ["LLM_FORGE_KERNELS"] = "torch"  # inherited by the server and its engines
    yield
    if old is None:
        os.environ.pop("LLM_FORGE_KERNELS", None)
    else:
        os.environ["LLM_FORGE_KERNELS"] = old


@pytest.fixture(scope="module")
def supervised(repository, torch_kernels):
    """A server under a supervisor allowed 2 reloads: the third failure is one too many."""
    lines: list[str] = []
    with running_tritonserver(repository) as server:
        supervisor = Supervisor(server.http_url, max_reloads=2, report=lines.append)
        supervisor.start()
        try:
            yield server, supervisor, lines
        finally:
            supervisor.stop()
            print("\n".join(lines))


def _stub(server) -> int:
    stub = _child_with(server.process.pid, "tensorrt_llm_0_0")
    assert stub is not None, [cmdline(c) for c in children(server.process.pid)]
    return stub


def test_only_the_launchers_secret_id_is_a_drain_request(monkeypatch):
    monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)
    assert not is_drain_request(DRAIN_REQUEST_ID) and not is_drain_request(drain_request_id(""))
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "s3cret")
    assert is_drain_request(drain_request_id("s3cret"))
    for guess in (DRAIN_REQUEST_ID, drain_request_id(""), drain_request_id("s3cre"), ""):
        assert not is_drain_request(guess)


@pytest.mark.slow
def test_a_client_cannot_drain_the_server_with_a_guessed_id(supervised):
    server, _, _ = supervised
    for request_id in (DRAIN_REQUEST_ID, drain_request_id(""), drain_request_id("0" * 32)):
        assert control_request(server.http_url, "tensorrt_llm", request_id, 10.0).ok is True
    assert _ready(server) and _answers(server, "tensorrt_llm_bls") and _answers(server, "ensemble")


@pytest.mark.slow
def test_a_killed_stub_is_reloaded_and_every_entry_point_serves_again(supervised):
    server, supervisor, lines = supervised
    assert _ready(server) and _answers(server, "ensemble")
    os.kill(_stub(server), signal.SIGKILL)
    not_ready = _poll(lambda: not _ready(server), 15)
    assert not_ready is not None, lines
    serving = _poll(lambda: _ready(server) and _answers(server, "ensemble"), 120)
    assert serving is not None, lines
    assert _answers(server, "tensorrt_llm_bls")
    assert any("Stub process 'tensorrt_llm_0_0' is not healthy" in line for line in lines)
    print(f"\nstub killed: not ready after {not_ready:.1f} s, serving again after "
          f"{not_ready + serving:.1f} s")


@pytest.mark.slow
def test_a_killed_preprocessing_stub_is_reloaded_and_the_ensemble_serves_again(supervised):
    server, _, _ = supervised
    lines: list[str] = []
    supervisor = Supervisor(server.http_url, model="preprocessing", hung_seconds=float("inf"),
                            report=lines.append)
    supervisor.start()
    try:
        for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
            assert probe_model(server.http_url, model).ok is True, probe_model(server.http_url,
                                                                               model)
        assert _answers(server, "ensemble")
        stub = _child_with(server.process.pid, "preprocessing_0_0")
        assert stub is not None
        os.kill(stub, signal.SIGKILL)
        serving = _poll(lambda: _ready(server) and _answers(server, "ensemble"), 120)
        assert serving is not None, lines
    finally:
        supervisor.stop()
    assert any("Stub process 'preprocessing_0_0' is not healthy" in line for line in lines), lines
    assert any("preprocessing reloaded" in line for line in lines), lines
    print(f"\npreprocessing stub killed: the ensemble serves again after {serving:.1f} s")


def _engine_pid(server) -> int | None:
    return engine_pid(server.metrics_url)


@pytest.mark.slow
def test_an_engine_down_for_good_makes_the_server_not_ready_then_serve_again(supervised):
    server, supervisor, lines = supervised
    # The crash-loop limit: 3 restarts within 300 s, so the 4th death of a ready engine is the
    # last. Each is killed once it is ready (its pid is published).
    killed: list[int] = []
    for _ in range(4):
        assert _poll(lambda: _engine_pid(server) not in (None, *killed), 120) is not None, lines
        killed.append(_engine_pid(server))
        os.kill(killed[-1], signal.SIGKILL)
    not_ready = _poll(lambda: not _ready(server), 15)
    assert not_ready is not None, lines
    serving = _poll(lambda: _ready(server) and _answers(server, "ensemble"), 120)
    assert serving is not None, lines
    assert any("tensorrt_llm: the engine is down (the engine process was killed by SIGKILL "
               "(exit code -9); "
               "4 crashes within 300 s" in line for line in lines), lines
    print(f"\nengine down for good: not ready after {not_ready:.1f} s, serving again after "
          f"{not_ready + serving:.1f} s")


@pytest.mark.slow
def test_past_the_reload_limit_the_server_stays_not_ready_and_says_why(supervised):
    server, supervisor, lines = supervised
    os.kill(_stub(server), signal.SIGKILL)
    assert _poll(supervisor.gave_up.is_set, 60) is not None, lines
    assert not _ready(server) and _poll(lambda: _ready(server), 5) is None
    assert "forge serve stopped reloading tensorrt_llm: 3 failures within 300 s, reload limit 2" \
        in lines[-1]
    with open(server.log_path, errors="replace") as log:
        assert "forge serve stopped reloading tensorrt_llm" in log.read()


# -- forge serve as a subprocess ----------------------------------------------------------------
@pytest.fixture(scope="module")
def long_repository(tmp_path_factory):
    """Room for 4000 new tokens: a stream the test cancels cannot end on its own first."""
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("long"), max_seq_len=4096,
                                   max_input_len=256, kv_cache_num_blocks=320)
    return emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))


@pytest.fixture
def forge_serve(repository, torch_kernels):
    started = []

    def start(*args: str, repository: Path = repository) -> ForgeServe:
        serve = ForgeServe(repository, *args)
        started.append(serve)
        serve.wait_serving()
        return serve

    yield start
    for serve in started:
        serve.close()


def _stream(url: str, model: str, max_tokens: int, answered: threading.Event | None = None
            ) -> tuple[str, int, str]:
    """('done', tokens, finish_reason) or ('error', tokens, message) for one streamed request;
    `answered` is set at its first response."""
    tokens, reason = 0, ""
    try:
        for chunk in stream_grpc(url, model, text_inputs(text_input="The quick brown fox",
                                                         max_tokens=max_tokens, stream=True),
                                 timeout=120):
            if answered is not None:
                answered.set()
            decode_text(chunk)
            tokens += int(chunk["output_ids"].size)
            reason = chunk["finish_reason"].reshape(-1)[0].decode()
    except RuntimeError as exc:
        return "error", tokens, str(exc)
    return "done", tokens, reason


@pytest.mark.slow
def test_sigterm_drains_sixteen_streams_and_exits_zero(forge_serve):
    serve = forge_serve("--drain-timeout", "4")
    # Half finish well within the drain, half cannot: they end with the drain error.
    plans = [("ensemble" if i % 2 else "tensorrt_llm_bls", 24 if i % 4 < 2 else 1000)
             for i in range(16)]
    pool = ThreadPoolExecutor(16)
    answered = [threading.Event() for _ in plans]
    futures = [pool.submit(_stream, serve.grpc_url, model, n, event)
               for (model, n), event in zip(plans, answered)]
    # Every stream in flight before the signal (on a busy machine 16 clients take a while to
    # send): one sent after it is refused, as the late one below shows.
    assert all(event.wait(60) for event in answered), [f.result() for f in futures if f.done()]
    serve.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    not_ready = _poll(lambda: not http_ok(f"http://{serve.http_url}/v2/health/ready"), 15)
    late = _stream(serve.grpc_url, "ensemble", 4)
    results = [future.result(timeout=120) for future in futures]
    drained = time.monotonic() - signalled
    try:
        code = serve.process.wait(60)
    except subprocess.TimeoutExpired:  # keep what forge serve said: the fixture deletes it
        pytest.fail(f"forge serve did not exit within 60 s of its streams ending "
                    f"({drained:.1f} s after SIGTERM):\n{serve.text()}")
    exited = time.monotonic() - signalled
    pool.shutdown()
    for (model, max_tokens), (kind, tokens, reason) in zip(plans, results):
        if (kind, tokens, reason) == ("done", max_tokens, "length"):
            continue  # finished in time
        assert tokens < max_tokens, (model, kind, tokens, reason)
        if model == "ensemble":  # takes no error after streaming (serving_control.py)
            assert (kind, reason) == ("done", "cancelled"), (model, kind, tokens, reason)
        else:  # cut at the drain timeout with the error that says to send it again
            assert kind == "error" and "the server is draining: the drain timeout (4 s) " \
                "expired before this request finished; send it again" in reason, \
                (model, kind, tokens, reason, serve.text())
    assert not_ready is not None
    assert late[0] == "error" and DRAIN_REFUSED in late[2], late
    assert code == 0, serve.text()
    assert re.search(r"drain: \d+ requests in flight ended after [0-9.]+ s \(drain timeout 4 s\)",
                     serve.text()), serve.text()
    done = sum(reason == "length" for _, _, reason in results)
    assert any(kind == "error" for kind, _, _ in results)  # the BLS's were cut
    print(f"\ndrain: not ready {not_ready:.2f} s after SIGTERM; {done} streams completed, "
          f"{16 - done} were cut at the drain timeout; all ended {drained:.1f} s and forge serve "
          f"exited 0 {exited:.1f} s after SIGTERM (drain timeout 4 s)")


@pytest.mark.slow
def test_a_drain_with_nothing_in_flight_says_so(forge_serve):
    serve = forge_serve("--drain-timeout", "4")
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(60) == 0
    assert "drain: no requests were in flight" in serve.text()
    assert "requests in flight ended" not in serve.text()


@pytest.mark.slow
def test_forge_serve_exits_nonzero_when_tritonserver_dies(forge_serve):
    serve = forge_serve()
    tritonserver = _child_with(serve.process.pid, "tritonserver")
    assert tritonserver is not None
    os.kill(tritonserver, signal.SIGKILL)
    assert serve.process.wait(30) == 1
    assert "error: tritonserver exited with code -9" in serve.text()


def _executor_stats(serve: ForgeServe) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{serve.metrics_port}/metrics",
                                timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'llm_forge_executor_stats\{[^}]*stat="(\w+)"[^}]*\} ([0-9.e+-]+)'
    return {name: float(value) for name, value in re.findall(pattern, text)}


def _cut_http_stream(serve: ForgeServe, model: str, max_tokens: int) -> int:
    """Start /generate_stream, read its first event, then drop the connection; returns the
    bytes read (the client a user kills with Ctrl-C)."""
    connection = http.client.HTTPConnection(serve.http_url, timeout=60)
    body = json.dumps({"text_input": "The quick brown fox", "max_tokens": max_tokens,
                       "stream": True})
    connection.request("POST", f"/v2/models/{model}/generate_stream", body=body,
                       headers={"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()
    first = reply.fp.readline()
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    return len(first)


@pytest.mark.slow
def test_cancelled_ensemble_streams_stop_the_engine_and_the_server_stops_clean(forge_serve,
                                                                               long_repository):
    """Triton 2.51 never tells the running tensorrt_llm step of a cancelled ensemble request;
    postprocessing, which it tells, stops the engine by the request's cancel key. Each stream
    asks for 4000 tokens and is dropped after its first chunk: it must end CANCELLED in the
    engine (counted cancelled, never completed, its blocks freed), and SIGTERM then finds
    nothing in flight, with no exit timeout in tritonserver's log."""
    serve = forge_serve("--drain-timeout", "4", repository=long_repository)
    before = _executor_stats(serve)
    chunks = stream_grpc(serve.grpc_url, "ensemble",
                         text_inputs(text_input="The quick brown fox", max_tokens=4000,
                                     stream=True))
    next(chunks)
    chunks.close()  # stop_stream(cancel_requests=True)
    assert _cut_http_stream(serve, "ensemble", 4000) > 0

    def settled():
        stats = _executor_stats(serve)
        return (stats["num_cancelled_requests"] - before["num_cancelled_requests"] == 2
                and stats["num_active_requests"] == 0 and stats["num_used_blocks"] == 0)

    waited = _poll(settled, 30)
    stats = _executor_stats(serve)
    assert waited is not None, stats
    assert stats["num_completed_requests"] == before["num_completed_requests"], stats
    assert streamed_ok(serve)  # and it keeps serving
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(60) == 0, serve.text()
    log = Path(re.search(r"tritonserver ready \(log: (.+)\)", serve.text()).group(1))
    assert "drain: no requests were in flight" in serve.text(), serve.text()
    assert "warning: tritonserver stopped at its exit timeout" not in serve.text()
    text = log.read_text(errors="replace")
    assert "Exit timeout expired" not in text
    assert not re.search(r"has [1-9][0-9]* in-flight inferences", text), text[-3000:]
    print(f"\nensemble cancel: both streams ended CANCELLED in the engine {waited:.2f} s after "
          f"the clients left")


@pytest.mark.slow
def test_a_cut_non_streamed_ensemble_request_runs_to_its_end_then_frees_its_blocks(
        forge_serve, long_repository):
    """What docs/triton-contract.md and the README say: a non-streamed `generate_stream` on the
    ensemble has no chunk for `postprocessing` to check, and Triton 2.51 tells no running step
    that its client left, so it generates to max_tokens, ends `length` (counted completed, not
    cancelled), and only then gives its blocks back; the server goes on serving. Should Triton
    start passing the cancellation on, this fails and the documents change with it."""
    serve = forge_serve(repository=long_repository)
    before = _executor_stats(serve)
    connection = http.client.HTTPConnection(serve.http_url, timeout=60)
    body = json.dumps({"text_input": "The quick brown fox", "max_tokens": 600})
    connection.request("POST", "/v2/models/ensemble/generate_stream", body=body,
                       headers={"Content-Type": "application/json"})
    assert _poll(lambda: _executor_stats(serve)["num_active_requests"] == 1, 30) is not None
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()

    def ended():
        stats = _executor_stats(serve)
        return (stats["num_completed_requests"] - before["num_completed_requests"] == 1
                and stats["num_active_requests"] == 0 and stats["num_used_blocks"] == 0)

    assert _poll(ended, 120) is not None, _executor_stats(serve)
    stats = _executor_stats(serve)
    assert stats["num_cancelled_requests"] == before["num_cancelled_requests"], stats
    assert stats["num_scheduled_tokens"] - before["num_scheduled_tokens"] >= 600, stats
    assert streamed_ok(serve)


def streamed_ok(serve: ForgeServe) -> bool:
    kind, tokens, reason = _stream(serve.grpc_url, "ensemble", 8)
    return (kind, tokens, reason) == ("done", 8, "length")

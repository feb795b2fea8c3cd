"""forge serve's probes end to end: a real `forge serve` (a subprocess on free loopback ports).

Startup answers 503 while tritonserver loads, then 200; readiness drops while the supervisor
reloads a killed stub and comes back, liveness stays 200 throughout; POST /drain turns
readiness off at once and forge serve exits 0, drained. `forge drain --wait` returns only once
a stream in flight has ended. An engine down for good with no reloads allowed fails readiness
and liveness. Triton's HTTP port stays on loopback while metrics open to every interface.
The engine runs with the pure-torch kernels (probes do not depend on them; restarts stay quick).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from builder.client import stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.health import DRAIN_PATH, LIVENESS_PATH, READINESS_PATH, STARTUP_PATH
from tests.triton_helpers import ForgeServe, build_tiny_engine, children, engine_pid


def probe(port: int, path: str) -> tuple[int | None, str]:
    """(HTTP status, the body's status) of a probe; (None, why) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, json.loads(reply.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]
    except (urllib.error.URLError, OSError) as exc:
        return None, str(exc)


def poll(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def _descendant_with(pid: int, text: str) -> int | None:
    for child in children(pid):
        try:
            cmdline = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            return child
        found = _descendant_with(child, text)
        if found is not None:
            return found
    return None


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("probed"), max_seq_len=1024,
                                   max_input_len=256)
    return emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))


@pytest.fixture
def forge_serve(repository, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_KERNELS", "torch")  # inherited by the server and its engines
    started: list[ForgeServe] = []

    def start(*args: str) -> ForgeServe:
        started.append(ForgeServe(repository, *args))
        return started[-1]

    yield start
    for serve in started:
        serve.close()


@pytest.mark.slow
def test_probes_follow_the_start_a_reload_and_the_drain(forge_serve):
    serve = forge_serve("--drain-timeout", "4")
    first: list[tuple[int | None, str]] = []
    assert poll(lambda: first.append(probe(serve.health, STARTUP_PATH)) or first[-1][0],
                60, 0.05), serve.text()
    assert first[-1] == (503, "starting"), first  # listening before tritonserver is ready
    assert probe(serve.health, READINESS_PATH) == (503, "starting")
    serve.wait_serving()
    assert probe(serve.health, STARTUP_PATH) == (200, "started")
    assert probe(serve.health, READINESS_PATH) == (200, "ready")
    assert probe(serve.health, LIVENESS_PATH) == (200, "live")
    assert f"health   http://127.0.0.1:{serve.health}{STARTUP_PATH}" in serve.text()

    # a killed tensorrt_llm stub: reloaded; liveness holds all along
    lives: list[tuple[int | None, str]] = []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            lives.append(probe(serve.health, LIVENESS_PATH))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stub = _descendant_with(serve.process.pid, "tensorrt_llm_0_0")
    assert stub is not None
    os.kill(stub, signal.SIGKILL)
    assert poll(lambda: probe(serve.health, READINESS_PATH)[0] == 503, 30), serve.text()
    assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 180), serve.text()
    watching.set()
    watcher.join(15)
    assert "tensorrt_llm reloaded" in serve.text()
    assert lives and set(lives) == {(200, "live")}, lives

    # POST /drain: readiness off at once, forge serve drains and exits 0
    request = urllib.request.Request(f"http://127.0.0.1:{serve.health}{DRAIN_PATH}", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 202
    assert probe(serve.health, READINESS_PATH)[0] == 503
    assert serve.process.wait(90) == 0, serve.text()
    assert "drain: no requests were in flight" in serve.text()
    assert probe(serve.health, LIVENESS_PATH)[0] is None  # the health port went with it
    print(f"\nthe health port answered startup 503 while tritonserver loaded; through the "
          f"reload {len(lives)} liveness answers, all 200")


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("192.0.2.1", 9))  # picks the outgoing interface; sends nothing
            address = udp.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.slow
def test_forge_drain_waits_for_the_stream_in_flight_and_triton_stays_on_loopback(forge_serve):
    serve = forge_serve("--drain-timeout", "4", "--metrics-host", "0.0.0.0", "--host", "0.0.0.0")
    serve.wait_serving()
    address = _non_loopback_address()
    if address is not None:  # metrics open to the pod's network, Triton's HTTP port not
        assert _answers(f"http://{address}:{serve.ports['metrics']}/metrics")
        assert not _answers(f"http://{address}:{serve.ports['http']}/v2/health/ready")
        assert _answers(f"http://127.0.0.1:{serve.ports['http']}/v2/health/ready")
        assert probe(serve.health, LIVENESS_PATH) == (200, "live")
    ended: list[str] = []
    first = threading.Event()

    def stream():  # 1000 tokens: cancelled at the drain timeout, with its final response
        reason = ""
        for chunk in stream_grpc(f"127.0.0.1:{serve.ports['grpc']}", "ensemble",
                                 text_inputs(text_input="The quick brown fox", max_tokens=1000,
                                             stream=True), timeout=120):
            first.set()
            reason = chunk["finish_reason"].reshape(-1)[0].decode()
        ended.append(reason)

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert first.wait(60), serve.text()
    drained = subprocess.run(
        [sys.executable, "-m", "builder.cli", "drain", "--health-port", str(serve.health),
         "--wait", "--timeout", "120"], capture_output=True, text=True, timeout=180)
    assert drained.returncode == 0, drained.stdout + drained.stderr + serve.text()
    assert ended in (["cancelled"], ["length"]), ended  # over before forge drain returned
    assert "drain: finished after" in drained.stdout
    assert serve.process.wait(90) == 0, serve.text()
    assert "drain: 1 requests in flight ended" in serve.text()


def _engine_pid(metrics_port: int) -> int | None:
    return engine_pid(f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.mark.slow
def test_a_frozen_engine_restarts_in_place_and_fails_liveness_only_when_it_cannot(forge_serve):
    """SIGSTOP is a frozen engine: the watchdog kills it within its freeze limit and starts a new
    one in place; meanwhile the pod is not ready but alive. The engine's crash-loop limit (the
    4th death within 300 s is the last) with no reloads left is recovery failing: liveness 503."""
    serve = forge_serve("--max-reloads", "0")
    serve.wait_serving()
    killed: list[int] = []
    for death in range(4):
        assert poll(lambda: _engine_pid(serve.ports["metrics"]) not in (None, *killed), 120), \
            serve.text()
        assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 60), \
            serve.text()
        killed.append(_engine_pid(serve.ports["metrics"]))
        assert probe(serve.health, LIVENESS_PATH) == (200, "live")
        frozen = death in (0, 3)
        os.kill(killed[-1], signal.SIGSTOP if frozen else signal.SIGKILL)
        if death == 0:  # restarting in place: not ready, alive, then ready again
            assert poll(lambda: probe(serve.health, READINESS_PATH) == (503, "restarting"), 30), \
                serve.text()
            assert probe(serve.health, LIVENESS_PATH) == (200, "live")
    assert poll(lambda: probe(serve.health, LIVENESS_PATH)[0] == 503, 60), serve.text()
    assert probe(serve.health, LIVENESS_PATH) == (503, "gave_up")
    assert probe(serve.health, READINESS_PATH) == (503, "gave_up")
    assert probe(serve.health, STARTUP_PATH) == (200, "started")
    # the health state turns first; the report follows the stand-in model's load
    assert poll(lambda: "forge serve stopped reloading tensorrt_llm" in serve.text(), 60), \
        serve.text()
    assert "made no progress for" in serve.text()
    assert "tensorrt_llm: the engine is down" in serve.text()


@pytest.mark.slow
def test_a_drain_right_after_a_recovery_exits_as_fast_as_without_one(forge_serve):
    """A killed `tensorrt_llm` stub, reloaded by the supervisor, then SIGTERM at once: forge
    serve exits within seconds, not at tritonserver's exit timeout (drain 4 s + 30 s)."""
    serve = forge_serve("--drain-timeout", "4")
    serve.wait_serving()
    assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 60), serve.text()
    stub = _descendant_with(serve.process.pid, "tensorrt_llm_0_0")
    assert stub is not None
    os.kill(stub, signal.SIGKILL)
    assert poll(lambda: probe(serve.health, READINESS_PATH)[0] == 503, 30), serve.text()
    assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 180), serve.text()
    signalled = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    code = serve.process.wait(90)
    exited = time.monotonic() - signalled
    assert code == 0, serve.text()
    assert "tritonserver stopped at its exit timeout" not in serve.text(), serve.text()
    assert "drain: no requests were in flight" in serve.text()
    assert exited < 20.0, f"exited {exited:.1f} s after SIGTERM:\n{serve.text()}"
    print(f"\nSIGTERM right after a reload: forge serve exited {exited:.1f} s later")


def _kill_next_engine(serve: ForgeServe, killed: list[int], timeout: float = 30) -> None:
    """SIGKILL the first engine process not killed yet, as soon as it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _descendant_with(serve.process.pid, "triton_backend.engine.process.main")
        if pid is not None and pid not in killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)
    raise AssertionError(f"no new engine process within {timeout} s:\n{serve.text()}")


@pytest.mark.slow
def test_repeated_kills_of_the_engine_recover_in_place_within_seconds(forge_serve):
    """Three kill -9 of the engine 1.5 s apart (the last two hit an engine still starting):
    within the restart budget each is replaced in place, the server is ready again within 15 s
    of the last kill, and what forge serve reports names the kill."""
    serve = forge_serve()
    serve.wait_serving()
    assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 60), serve.text()
    killed: list[int] = []
    for _ in range(3):
        _kill_next_engine(serve, killed)
        time.sleep(1.5)
    last_kill = time.monotonic() - 1.5
    assert poll(lambda: probe(serve.health, READINESS_PATH) == (200, "ready"), 60), serve.text()
    back = time.monotonic() - last_kill
    text = serve.text()
    assert back < 15.0, f"ready again {back:.1f} s after the last kill:\n{text}"
    assert "killed by SIGKILL (exit code -9)" in text, text
    assert "did not start within" not in text, text
    assert "reloaded" not in text and "cannot serve" not in text, text  # all in place
    print(f"\nthree kills 1.5 s apart: ready again {back:.1f} s after the last")

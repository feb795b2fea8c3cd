"""forge serve's probes without a server: what `HealthState` answers as the supervisors and the
main thread report, the health port over real loopback sockets (its paths, the loopback-only
drain, its connection bound), the bind addresses and `forge drain` against a stand-in."""
import http.client
import json
import socket
import threading
import time

import pytest
from click.testing import CliRunner

from builder.cli.drain import drain_command
from builder.serving.addresses import bind_address, check_port_free, connect_host
from builder.serving.health import (DRAIN_PATH, LIVENESS_PATH, READINESS_PATH, STARTUP_PATH,
                                    HealthState)
from builder.serving.health_server import MAX_CONNECTIONS, HealthServer, is_loopback
from builder.serving.serve import TritonInstall, free_port, server_command


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def answers(state: HealthState) -> tuple[tuple[int, str], ...]:
    return tuple((verdict.http_status, verdict.status)
                 for verdict in (state.startup(), state.readiness(), state.liveness()))


def test_before_the_start_only_liveness_holds_then_all_three():
    state = HealthState()
    assert answers(state) == ((503, "starting"), (503, "starting"), (200, "live"))
    state.mark_started()
    assert answers(state) == ((200, "started"), (200, "ready"), (200, "live"))


def test_an_engine_restarting_is_alive_but_not_ready_until_the_live_limit():
    clock = Clock()
    state = HealthState(live_limit=120.0, clock=clock)
    state.mark_started()
    state.serving("tensorrt_llm")
    state.restarting("tensorrt_llm", "tensorrt_llm: the engine is restarting (it froze)")
    clock.now += 30
    state.restarting("tensorrt_llm", "tensorrt_llm: the engine is restarting (it froze)")
    assert answers(state) == ((200, "started"), (503, "restarting"), (200, "live"))
    assert state.readiness().reason == ("tensorrt_llm restarting for 30.0 s: tensorrt_llm: the "
                                        "engine is restarting (it froze)")
    clock.now += 89
    assert state.liveness().ok
    clock.now += 2  # 121 s without serving: neither the restart nor anything else brought it back
    assert answers(state)[1:] == ((503, "restarting"), (503, "stalled"))
    assert state.liveness().reason.startswith("tensorrt_llm has not answered its probe as "
                                              "serving for 121 s (limit 120 s; now restarting")
    state.serving("tensorrt_llm")
    assert answers(state) == ((200, "started"), (200, "ready"), (200, "live"))


def test_the_live_limit_counts_from_the_last_serving_answer_across_a_reload():
    clock = Clock()
    state = HealthState(live_limit=120.0, clock=clock)
    state.mark_started()
    state.serving("tensorrt_llm")
    state.restarting("tensorrt_llm", "restarting")
    clock.now += 60
    state.unloaded("tensorrt_llm", "the engine still restarting after 60 s")  # a reload
    assert answers(state)[1:] == ((503, "unloaded"), (200, "live"))
    assert state.readiness().reason.startswith("tensorrt_llm unloaded for 0.0 s")
    clock.now += 61
    assert answers(state)[1:] == ((503, "unloaded"), (503, "stalled"))


def test_no_answer_keeps_readiness_but_counts_against_liveness():
    clock = Clock()
    state = HealthState(live_limit=120.0, clock=clock)
    state.mark_started()
    state.unanswered("preprocessing", "no answer: timed out")
    assert answers(state)[1:] == ((200, "ready"), (200, "live"))
    clock.now += 121
    assert answers(state)[1:] == ((200, "ready"), (503, "stalled"))


def test_giving_up_fails_readiness_and_liveness_at_once():
    state = HealthState()
    state.mark_started()
    state.serving("preprocessing")
    state.gave_up("tensorrt_llm", "forge serve stopped reloading tensorrt_llm: 1 failures")
    assert answers(state) == ((200, "started"), (503, "gave_up"), (503, "gave_up"))
    assert state.liveness().reason == ("tensorrt_llm: forge serve stopped reloading "
                                       "tensorrt_llm: 1 failures")


def test_a_drain_turns_readiness_off_and_leaves_liveness_alone():
    state = HealthState()
    state.mark_started()
    state.begin_drain()
    assert state.draining
    assert answers(state) == ((200, "started"), (503, "draining"), (200, "live"))
    state.mark_drained()
    assert answers(state) == ((200, "started"), (503, "drained"), (200, "live"))
    with pytest.raises(ValueError, match="live_limit must be a number of seconds > 0"):
        HealthState(live_limit=0)


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.1.2.3", False), ("::ffff:10.1.2.3", False), ("0.0.0.0", False), ("fe80::1%eth0", False),
    ("", False), ("localhost", False)])
def test_only_loopback_clients_count_as_loopback(address, loopback):
    assert is_loopback(address) is loopback


def _request(url: str, method: str, path: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


@pytest.fixture
def health_port():
    state, drains = HealthState(), []
    server = HealthServer(state, "127.0.0.1", 0, lambda: drains.append(state.begin_drain()))
    yield server, state, drains
    server.stop()


def test_the_health_port_answers_each_probe_and_takes_the_drain(health_port):
    server, state, drains = health_port
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert _request(server.url, "GET", STARTUP_PATH) == (
        503, {"status": "starting", "reason": "tritonserver is loading the models"})
    state.mark_started()
    for path in (STARTUP_PATH, READINESS_PATH + "?verbose=1", LIVENESS_PATH):
        assert _request(server.url, "GET", path)[0] == 200, path
    assert _request(server.url, "GET", DRAIN_PATH)[0] == 405
    assert _request(server.url, "POST", READINESS_PATH)[0] == 405
    assert _request(server.url, "GET", "/v2/health/ready")[0] == 404
    assert drains == []
    assert _request(server.url, "POST", DRAIN_PATH) == (
        202, {"status": "draining", "reason": "the drain has started"})
    assert len(drains) == 1
    assert _request(server.url, "GET", READINESS_PATH)[1]["status"] == "draining"


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks the interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback(address) or address == "0.0.0.0" else address


def test_a_drain_from_another_address_is_forbidden():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    state, drains = HealthState(), []
    server = HealthServer(state, "0.0.0.0", 0, lambda: drains.append(1))
    try:
        assert server.url == f"http://127.0.0.1:{server.port}"  # a wildcard is reached locally
        status, body = _request(f"http://{address}:{server.port}", "POST", DRAIN_PATH)
        assert (status, body["status"]) == (403, "forbidden") and drains == []
        assert _request(f"http://{address}:{server.port}", "GET", LIVENESS_PATH)[0] == 200
        assert _request(server.url, "POST", DRAIN_PATH)[0] == 202 and drains == [1]
    finally:
        server.stop()


def _timed_probe(url: str) -> float:
    """Seconds a liveness probe took to answer 200 (any other outcome fails the test)."""
    started = time.monotonic()
    status, _ = _request(url, "GET", LIVENESS_PATH)
    assert status == 200
    return time.monotonic() - started


def test_idle_and_slow_connections_never_keep_a_probe_waiting(health_port):
    """100 connections that send nothing and 100 that trickle a request a byte at a time, all
    held open: every probe still answers within 1 s (the kubelet's would otherwise fail and
    restart the pod)."""
    server, state, _ = health_port
    state.mark_started()
    address = ("127.0.0.1", server.port)
    idle = [socket.create_connection(address) for _ in range(100)]
    slow = [socket.create_connection(address) for _ in range(100)]
    stop = threading.Event()

    def trickle():
        request = f"GET {LIVENESS_PATH} HTTP/1.1\r\nHost: x\r\n".encode()
        for i in range(len(request) * 100):
            for connection in slow:
                try:
                    connection.send(request[i % len(request):][:1])
                except OSError:
                    pass
            if stop.wait(0.25):
                return

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    took = []
    try:
        for _ in range(30):
            took.append(_timed_probe(server.url))
            time.sleep(0.1)
    finally:
        stop.set()
        trickler.join(10)
        for connection in idle + slow:
            connection.close()
    assert max(took) < 1.0, took
    print(f"\nhealth port, 100 idle + 100 slow connections held: 30 probes, slowest "
          f"{max(took) * 1000:.1f} ms")


def test_past_the_bound_the_oldest_waiting_connection_is_closed(health_port):
    server, _, _ = health_port
    address = ("127.0.0.1", server.port)
    first = socket.create_connection(address, timeout=10)
    held = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        assert _timed_probe(server.url) < 1.0  # the bound's one extra: the oldest goes
        assert first.recv(100) == b""
        assert _timed_probe(server.url) < 1.0
    finally:
        for connection in [first, *held]:
            connection.close()


def test_a_request_trickled_past_the_deadline_is_cut_unanswered():
    state = HealthState()
    server = HealthServer(state, "127.0.0.1", 0, lambda: None, client_seconds=1.0)
    try:
        connection = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        connection.settimeout(0.1)
        started, closed = time.monotonic(), None
        for byte in f"GET {LIVENESS_PATH} HTTP/1.0\r\n".encode() * 10:
            try:
                connection.send(bytes([byte]))
                if connection.recv(100) == b"":
                    closed = time.monotonic() - started
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = time.monotonic() - started
                break
        connection.close()
        assert closed is not None and 0.9 < closed < 3.0, closed
        assert _request(server.url, "GET", LIVENESS_PATH)[0] == 200
    finally:
        server.stop()
        server.stop()  # idempotent


def test_a_port_in_use_and_a_bad_address_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--triton-host 'localhost': expected an IP address"):
        bind_address("localhost", "--triton-host")
    assert bind_address("0.0.0.0", "--metrics-host") == "0.0.0.0"
    assert (connect_host("0.0.0.0"), connect_host("::"), connect_host("10.0.0.7"),
            connect_host("fd00::7")) == ("127.0.0.1", "[::1]", "10.0.0.7", "[fd00::7]")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--grpc-port {port}: cannot bind 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port, "--grpc-port")
    check_port_free("127.0.0.1", 0, "--http-port")  # 0: a free one is picked later


def test_tritonserver_binds_triton_and_metrics_ports_where_asked(tmp_path):
    install = TritonInstall(binary=tmp_path / "tritonserver")
    default = server_command(install, tmp_path, (1, 2, 3), None)
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1"} <= set(default)
    opened = server_command(install, tmp_path, (1, 2, 3), None, hosts=("127.0.0.1", "0.0.0.0"))
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--metrics-address=0.0.0.0"} <= set(opened)
    with pytest.raises(ValueError, match="--metrics-host 'all'"):
        server_command(install, tmp_path, (1, 2, 3), None, hosts=("127.0.0.1", "all"))


def test_forge_drain_posts_and_waits_until_drained(health_port):
    server, state, drains = health_port
    state.mark_started()
    finish = threading.Timer(0.5, state.mark_drained)  # forge serve's drain, a moment later
    finish.start()
    result = CliRunner().invoke(drain_command, ["--health-port", str(server.port), "--wait",
                                                "--timeout", "30"])
    finish.join()
    assert result.exit_code == 0, result.output
    assert len(drains) == 1
    assert result.output.startswith(f"drain: the drain has started ({server.url})\n")
    assert "drain: finished after" in result.output


def test_forge_drain_names_the_cause_when_nothing_answers_or_it_does_not_finish(health_port):
    port = free_port()
    result = CliRunner().invoke(drain_command, ["--health-port", str(port)])
    assert result.exit_code == 1
    assert f"error: nothing answers on http://127.0.0.1:{port} (" in result.output
    server, _, _ = health_port  # answers, but never drains
    result = CliRunner().invoke(drain_command, ["--health-port", str(server.port), "--wait",
                                                "--timeout", "1"])
    assert result.exit_code == 1
    assert "had not finished draining after 1 s" in result.output
    result = CliRunner().invoke(drain_command, ["--host", "pod"])
    assert result.exit_code == 2 and "--host 'pod': expected an IP address" in result.output


@pytest.mark.parametrize("option", ["--health-port", "--http-port", "--metrics-port"])
def test_forge_serve_refuses_a_port_in_use_before_starting_anything(tmp_path, option):
    """Exit 2 naming the option, before tritonserver starts (and before its signal handlers)."""
    from builder.cli.serve import serve_command

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--health-port": "0", "--http-port": "0", "--grpc-port": "0",
                 "--metrics-port": "0", option: str(port)}
        result = CliRunner().invoke(serve_command, ["--repository", str(tmp_path),
                                                    *(item for pair in ports.items()
                                                      for item in pair)])
    assert result.exit_code == 2, result.output
    assert f"error: {option} {port}: cannot bind 127.0.0.1:{port}" in result.output


def test_forge_serve_refuses_an_address_that_is_not_an_ip_address(tmp_path):
    from builder.cli.serve import serve_command

    result = CliRunner().invoke(serve_command, ["--repository", str(tmp_path), "--triton-host",
                                                "pod.local", "--health-port", "0"])
    assert result.exit_code == 2
    assert "error: --triton-host 'pod.local': expected an IP address" in result.output


def test_forge_serve_refuses_a_missing_repository_as_bad_input(tmp_path):
    from builder.cli.serve import serve_command

    result = CliRunner().invoke(serve_command, ["--repository", str(tmp_path / "missing"),
                                                "--health-port", "0"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--repository': Directory '{tmp_path / 'missing'}' does not " \
           f"exist" in result.output

"""`forge serve`'s health port: the probes of `health.py` over HTTP, and the drain.

A small stdlib HTTP server on threads of its own, so a slow client never holds up forge serve's
main loop. Bounded: at most `MAX_CONNECTIONS` connections are served at once (more are closed
unanswered), each gets `CLIENT_SECONDS` to send its request, and no request body is read.

GET on a probe path answers `{"status", "reason"}` with 200 or 503. POST on `DRAIN_PATH` starts
the drain (`on_drain`, what SIGTERM does) and answers 202, for loopback clients only (403 for
any other): the health port may face the cluster (`--host 0.0.0.0` in a pod), the drain is for
the pod's own preStop hook (`forge drain`).
"""
from __future__ import annotations

import ipaddress
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from builder.serving.addresses import connect_host
from builder.serving.health import (DRAIN_PATH, LIVENESS_PATH, READINESS_PATH, STARTUP_PATH,
                                    HealthState)

MAX_CONNECTIONS = 16
CLIENT_SECONDS = 5.0


def is_loopback(address: str) -> bool:
    """True for a loopback client address (127.0.0.0/8, ::1, or IPv4 loopback mapped in IPv6)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    timeout = CLIENT_SECONDS  # a client that sends nothing frees its thread
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        state = self.server.state
        probes = {STARTUP_PATH: state.startup, READINESS_PATH: state.readiness,
                  LIVENESS_PATH: state.liveness}
        path = self.path.split("?", 1)[0]
        if path == DRAIN_PATH:
            self._reply(405, {"status": "error", "reason": f"{DRAIN_PATH} takes POST"})
        elif path in probes:
            verdict = probes[path]()
            self._reply(verdict.http_status, verdict.body())
        else:
            self._reply(404, {"status": "error", "reason": f"no such path: {path}"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path != DRAIN_PATH:
            self._reply(405 if path in (STARTUP_PATH, READINESS_PATH, LIVENESS_PATH) else 404,
                        {"status": "error", "reason": f"POST is only for {DRAIN_PATH}"})
        elif not is_loopback(self.client_address[0]):
            self._reply(403, {"status": "forbidden",
                              "reason": "the drain is taken from loopback clients only"})
        else:
            self.server.on_drain()
            self._reply(202, {"status": "draining", "reason": "the drain has started"})

    def _reply(self, status: int, body: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass  # probes every few seconds would drown forge serve's own lines


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stopping never waits for a slow client
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: HealthState,
                 on_drain: Callable[[], None]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.state, self.on_drain = state, on_drain
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HealthServer:
    """The health port, listening from construction (so a port in use fails at once, before
    tritonserver starts) until `stop()`."""

    def __init__(self, state: HealthState, host: str, port: int,
                 on_drain: Callable[[], None]) -> None:
        self._server = _Server((host, port), state, on_drain)
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="forge-serve-health", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

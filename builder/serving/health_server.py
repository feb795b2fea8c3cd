"""`forge serve`'s health port: the probes of `health.py` over HTTP, and the drain.

The port may face the whole cluster (`--host 0.0.0.0` in a pod: the kubelet probes from the
node, which a NetworkPolicy cannot name portably), so no client may keep the kubelet from an
answer. One asyncio loop on a thread of its own serves every connection, so a slow client never
holds up forge serve's main loop nor another client. Bounded:

- each connection has `CLIENT_SECONDS` in all to send its request line and headers (a client
  trickling a byte at a time is cut then, whatever it still sends), at most `MAX_REQUEST_BYTES`
  of them; no body is read;
- at most `MAX_CONNECTIONS` connections are open; a new one past the bound closes the oldest
  one still waiting for its request, so idle or slow connections held open cannot starve the
  probes (a thread per connection and a bound of 16 did: 20 idle connections left
  `/health/live` unanswered 60 rounds out of 75).

GET on a probe path answers `{"status", "reason"}` with 200 or 503. POST on `DRAIN_PATH` starts
the drain (`on_drain`, what SIGTERM does) and answers 202, for loopback clients only (403 for
any other): the drain is for the pod's own preStop hook (`forge drain`).
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
from http import HTTPStatus
from typing import Callable

from builder.serving.addresses import connect_host
from builder.serving.health import (DRAIN_PATH, LIVENESS_PATH, READINESS_PATH, STARTUP_PATH,
                                    HealthState)

MAX_CONNECTIONS = 256
CLIENT_SECONDS = 5.0
MAX_REQUEST_BYTES = 8192
_PROBES = (STARTUP_PATH, READINESS_PATH, LIVENESS_PATH)


def is_loopback(address: str) -> bool:
    """True for a loopback client address (127.0.0.0/8, ::1, or IPv4 loopback mapped in IPv6)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def answer(state: HealthState, on_drain: Callable[[], None], method: str, target: str,
           client: str) -> tuple[int, dict[str, str]]:
    """(HTTP status, JSON body) of one request."""
    path = target.split("?", 1)[0]
    probes = {STARTUP_PATH: state.startup, READINESS_PATH: state.readiness,
              LIVENESS_PATH: state.liveness}
    if method == "GET":
        if path == DRAIN_PATH:
            return 405, {"status": "error", "reason": f"{DRAIN_PATH} takes POST"}
        if path in probes:
            verdict = probes[path]()
            return verdict.http_status, verdict.body()
        return 404, {"status": "error", "reason": f"no such path: {path}"}
    if method != "POST" or path != DRAIN_PATH:
        return (405 if path in _PROBES or path == DRAIN_PATH else 404,
                {"status": "error", "reason": f"POST is only for {DRAIN_PATH}"})
    if not is_loopback(client):
        return 403, {"status": "forbidden",
                     "reason": "the drain is taken from loopback clients only"}
    on_drain()
    return 202, {"status": "draining", "reason": "the drain has started"}


def _reply(status: int, body: dict[str, str]) -> bytes:
    data = json.dumps(body).encode()
    head = (f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n")
    return head.encode() + data


async def _read_head(reader: asyncio.StreamReader) -> list[str] | None:
    """The request line's words, once the headers have ended; None for a malformed request."""
    first, size = b"", 0
    while True:
        line = await reader.readline()
        size += len(line)
        if not line or size > MAX_REQUEST_BYTES or not line.endswith(b"\n"):
            return None  # closed early, too long, or a line over the reader's limit
        if not first:
            first = line
        elif line in (b"\r\n", b"\n"):
            words = first.decode("latin-1").split()
            return words if len(words) == 3 else None


class HealthServer:
    """The health port, listening from construction (so a port in use fails at once, before
    tritonserver starts) until `stop()`."""

    def __init__(self, state: HealthState, host: str, port: int,
                 on_drain: Callable[[], None], client_seconds: float = CLIENT_SECONDS) -> None:
        self.host, self.state, self.on_drain = host, state, on_drain
        self.client_seconds = client_seconds
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._loop = asyncio.new_event_loop()
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # unanswered, oldest first
        self._server = self._loop.run_until_complete(asyncio.start_server(
            self._serve, sock=sock, limit=MAX_REQUEST_BYTES))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="forge-serve-health", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._waiting[writer] = None
        if len(self._waiting) > MAX_CONNECTIONS:
            oldest = next(iter(self._waiting))
            self._waiting.pop(oldest)
            oldest.transport.abort()  # its handler sees the reader end and returns
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self.client_seconds)
        except (asyncio.TimeoutError, ConnectionError, ValueError):
            pass  # too slow, gone, or over the size bound: closed unanswered
        finally:
            self._waiting.pop(writer, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                        ) -> None:
        words = await _read_head(reader)
        self._waiting.pop(writer, None)  # answered now: never the one evicted
        if words is None:
            return
        peer = writer.get_extra_info("peername") or ("",)
        status, body = answer(self.state, self.on_drain, words[0], words[1], str(peer[0]))
        writer.write(_reply(status, body))
        await writer.drain()

    async def _shutdown(self) -> None:
        self._server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    def stop(self) -> None:
        """Close the port and every connection; idempotent."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5.0)
        except Exception:  # stopping anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

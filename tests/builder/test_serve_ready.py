"""`TritonServer.wait_ready` on stand-in ports (no tritonserver): ready means the health endpoint
says so *and* /metrics answers, which Triton starts a moment after its HTTP service."""
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from builder.serving.serve import LOOPBACK, TritonServer, free_port


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((LOOPBACK, port), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_ready_waits_for_the_metrics_port_as_well(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    http, metrics = _serve(free_port()), None
    server = TritonServer(process, http.server_address[1], free_port(), free_port(),
                          tmp_path / "tritonserver.log", tmp_path)
    try:
        assert server.is_ready()
        with pytest.raises(TimeoutError, match="tritonserver not ready after 1s"):
            server.wait_ready(1.0)  # health says ready, /metrics is not listening yet
        metrics = _serve(server.metrics_port)
        server.wait_ready(5.0)
    finally:
        for stub in (http, metrics):
            if stub is not None:
                stub.shutdown()
        process.kill()
        process.wait(10)

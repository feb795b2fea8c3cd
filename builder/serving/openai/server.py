"""The OpenAI endpoint on uvicorn in a background thread, beside a running tritonserver.

`forge serve --openai-port` and the tests start it the same way: `start_openai_server(config)`
returns once the socket listens, `stop()` lets in-flight requests finish (up to a timeout).
Signals stay with the main thread (uvicorn installs no handlers off the main thread).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from builder.serving.openai.config import OpenAIServerConfig


@dataclass
class OpenAIServer:
    config: OpenAIServerConfig
    server: object  # uvicorn.Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():  # in-flight streams did not end in time: close them
            self.server.force_exit = True
            self.thread.join(timeout)

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_openai_server(config: OpenAIServerConfig, ready_timeout: float = 60.0) -> OpenAIServer:
    """Build the app (loads the tokenizer), serve it in a thread, wait until it listens."""
    import uvicorn

    from builder.serving.openai.app import create_app

    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="openai-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the OpenAI server on {config.host}:{config.port} failed to "
                               "start (is the port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the OpenAI server did not start within {ready_timeout:g}s")
        time.sleep(0.05)
    return OpenAIServer(config, server, thread)

"""One Triton gRPC stream (tritonclient's streaming API) and the requests it carries.

The synchronous streaming client under `forge query` (`client.stream_grpc`), `forge bench`'s
gRPC client (`bench.clients.GrpcStreamClient`) and the engine-level bench through Triton
(`bench.engine_level_triton`): decoupled models answer only on a stream, every request asks
for Triton's empty final response so its end is always seen, and each response is timed the
moment tritonclient's callback thread receives it. Triton's stream errors carry no request id:
a client that must know which request failed sends one at a time on a stream (`responses`);
the engine-level bench sends many and fails the whole run on an error (`next_response`).

The OpenAI proxy's client (`serving/openai/triton.py`) is the asyncio twin, on
`tritonclient.grpc.aio`, one stream per request inside the proxy's event loop.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np


class StreamError(RuntimeError):
    """The server answered the request with an error (its message is the text)."""


@dataclass(frozen=True)
class StreamResponse:
    arrived: float  # time.perf_counter() in the callback thread
    request_id: str
    result: Any  # tritonclient's InferResult
    final: bool

    def outputs(self) -> dict[str, np.ndarray]:
        return {o.name: self.result.as_numpy(o.name) for o in self.result.get_response().outputs}

    def output(self, name: str) -> np.ndarray | None:
        return self.result.as_numpy(name)


def infer_inputs(arrays: dict[str, np.ndarray], module: Any = None) -> list:
    """tritonclient `InferInput`s for typed arrays (gRPC's, or those of `module`, e.g. the HTTP
    client's)."""
    from tritonclient.utils import np_to_triton_dtype

    if module is None:
        import tritonclient.grpc as module
    tensors = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class GrpcStream:
    """A tritonclient gRPC connection with one open stream; `send` a request, then read its
    `responses`; `restart` cancels whatever the stream still carries and opens a fresh one."""

    def __init__(self, url: str, headers: dict[str, str] | None = None,
                 check_live: bool = False) -> None:
        """`check_live`: first ask the server whether it answers (`ConnectionError` naming `url`
        if not), on the connection the stream then uses."""
        import tritonclient.grpc as grpcclient

        self.url, self._headers = url, headers
        self._client = grpcclient.InferenceServerClient(url)
        if check_live:
            try:
                self._client.is_server_live()
            except Exception as exc:  # tritonclient's own exception types
                self._client.close()
                raise ConnectionError(f"{url}: server not reachable ({exc})") from None
        self._start()

    def _start(self) -> None:
        arrivals: queue.Queue = queue.Queue()
        self._arrivals = arrivals
        self._client.start_stream(
            callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)),
            headers=self._headers)

    def send(self, model: str, tensors: list, request_id: str = "",
             timeout_us: int | None = None, outputs: list | None = None) -> None:
        """Send one request (`tensors`: `infer_inputs(...)`; `outputs`: `InferRequestedOutput`s,
        all when None); `timeout_us` is Triton's own request timeout, a deadline the models
        honour."""
        self._client.async_stream_infer(model, tensors, request_id=request_id,
                                        enable_empty_final_response=True,
                                        timeout=timeout_us or None, outputs=outputs)

    def next_response(self, timeout: float) -> StreamResponse:
        """The next response of any request the stream carries. Raises `StreamError` on an error
        response and `TimeoutError` when nothing arrives for `timeout` s."""
        try:
            arrived, result, error = self._arrivals.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise TimeoutError(f"no response within {timeout:g} s") from None
        if error is not None:
            raise StreamError(str(error))
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        return StreamResponse(arrived, response.id, result, final is not None and final.bool_param)

    def responses(self, request_id: str, timeout: float, deadline: float | None = None
                  ) -> Iterator[StreamResponse]:
        """The responses of the one request sent under `request_id`, up to its final one;
        responses of an earlier, abandoned request are skipped. Raises as `next_response` does,
        `TimeoutError` also when `deadline` (a `time.perf_counter()` value) passes."""
        while True:
            wait = timeout if deadline is None else min(timeout, deadline - time.perf_counter())
            response = self.next_response(wait)
            if response.request_id != request_id:
                continue
            yield response
            if response.final:
                return

    def restart(self) -> None:
        """Cancel the requests the stream carries (freeing their slots) and open a fresh one."""
        self._client.stop_stream(cancel_requests=True)
        self._start()

    def close(self, cancel: bool = True) -> None:
        try:
            self._client.stop_stream(cancel_requests=cancel)
        finally:
            self._client.close()

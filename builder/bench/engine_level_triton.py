"""Engine-level protocol sides through a running `tritonserver`: the `tensorrt_llm` model (token
ids in, over one gRPC stream) and the `ensemble` (text in). Times are taken in tritonclient's
callback the moment a response arrives; tokens are counted from the server's
`num_output_tokens`, so a chunk of several tokens counts as several arrivals at that moment.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from builder.bench.engine_level import (AllTimings, EngineProtocol, OneTimings, all_timings,
                                        one_timings)
from builder.client import text_inputs
from builder.client.grpc_stream import GrpcStream, StreamError, infer_inputs

TIMEOUT_S = 1800.0


class TritonSide:
    def __init__(self, grpc_url: str, model: str, protocol: EngineProtocol) -> None:
        import tritonclient.grpc as grpcclient

        if model not in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
            raise ValueError(f"model must be tensorrt_llm, ensemble or tensorrt_llm_bls, "
                             f"got {model!r}")
        self.model = model
        self.protocol = protocol
        self._stream = GrpcStream(grpc_url)
        self._counter = 0
        self._lock = threading.Lock()
        # What a client reading the tokens asks for: the ids (or text) and the count.
        payload = "output_ids" if model == "tensorrt_llm" else "text_output"
        self._outputs = [grpcclient.InferRequestedOutput(name)
                         for name in (payload, "num_output_tokens")]

    def _send(self, ids: list[int], text: str, max_tokens: int | None = None) -> str:
        n = max_tokens or self.protocol.max_tokens
        if self.model == "tensorrt_llm":
            arrays = {"input_ids": np.array([ids], np.int32),
                      "input_lengths": np.array([[len(ids)]], np.int32),
                      "request_output_len": np.array([[n]], np.int32),
                      "min_tokens": np.array([[n]], np.int32),
                      "streaming": np.array([[True]]),
                      "return_num_output_tokens": np.array([[True]])}
        else:
            arrays = text_inputs(text_input=text, max_tokens=n, min_tokens=n, stream=True)
        with self._lock:
            self._counter += 1
            request_id = f"engine-level-{self._counter}"
        self._stream.send(self.model, infer_inputs(arrays), request_id, outputs=self._outputs)
        return request_id

    def _collect(self, request_ids: set[str], max_tokens: int | None = None
                 ) -> dict[str, list[float]]:
        """Arrival time of every generated token, per request, until all are final."""
        times: dict[str, list[float]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        deadline = time.monotonic() + TIMEOUT_S
        while pending:
            try:
                response = self._stream.next_response(max(1.0, deadline - time.monotonic()))
            except StreamError as exc:
                raise RuntimeError(f"{self.model}: {exc}") from None
            if response.request_id not in times:
                continue
            count = response.output("num_output_tokens")
            arrivals = times[response.request_id]
            new = (int(count.reshape(-1)[0]) if count is not None else 0) - len(arrivals)
            arrivals.extend([response.arrived] * max(0, new))
            if response.final:
                pending.discard(response.request_id)
        expected = max_tokens or self.protocol.max_tokens
        for rid, arrivals in times.items():
            if len(arrivals) != expected:
                raise RuntimeError(f"{self.model}: request {rid} generated {len(arrivals)} "
                                   f"tokens, expected {expected}")
        return times

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        start = time.perf_counter()
        rid = self._send(ids, text, max_tokens)
        return one_timings(start, self._collect({rid}, max_tokens)[rid])

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        start = time.perf_counter()
        rids = {self._send(ids, text) for ids, text in zip(ids_list, texts)}
        times = self._collect(rids)
        return all_timings(start, [t[0] for t in times.values()],
                           [t[-1] for t in times.values()],
                           len(ids_list) * self.protocol.max_tokens)

    def close(self) -> None:
        self._stream.close()

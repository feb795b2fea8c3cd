"""Engine-level protocol sides through a running `tritonserver`: the `tensorrt_llm` model (token
ids in, over one gRPC stream) and the `ensemble` (text in). Times are taken in tritonclient's
callback the moment a response arrives; tokens are counted from the server's
`num_output_tokens`, so a chunk of several tokens counts as several arrivals at that moment.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from builder.bench.engine_level import (AllTimings, EngineProtocol, OneTimings, all_timings,
                                        one_timings)

TIMEOUT_S = 1800.0


class TritonSide:
    def __init__(self, grpc_url: str, model: str, protocol: EngineProtocol) -> None:
        import tritonclient.grpc as grpcclient

        if model not in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
            raise ValueError(f"model must be tensorrt_llm, ensemble or tensorrt_llm_bls, "
                             f"got {model!r}")
        self._grpc = grpcclient
        self.model = model
        self.protocol = protocol
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._events: queue.Queue = queue.Queue()
        self._client.start_stream(callback=self._on_response)
        self._counter = 0
        self._lock = threading.Lock()
        # What a client reading the tokens asks for: the ids (or text) and the count.
        payload = "output_ids" if model == "tensorrt_llm" else "text_output"
        self._outputs = [grpcclient.InferRequestedOutput(name)
                         for name in (payload, "num_output_tokens")]

    def _on_response(self, result: Any, error: Any) -> None:
        now = time.perf_counter()
        if error is not None:
            self._events.put((now, None, 0, True, str(error)))
            return
        response = result.get_response()
        count = result.as_numpy("num_output_tokens")
        final = response.parameters["triton_final_response"].bool_param
        self._events.put((now, response.id, int(count.reshape(-1)[0]) if count is not None
                          else 0, final, None))

    def _input(self, name: str, value, datatype: str):
        array = np.asarray(value, dtype={"INT32": np.int32, "BOOL": np.bool_,
                                         "BYTES": np.object_}[datatype])
        array = array.reshape(1, -1)
        tensor = self._grpc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _send(self, ids: list[int], text: str, max_tokens: int | None = None) -> str:
        n = max_tokens or self.protocol.max_tokens
        if self.model == "tensorrt_llm":
            tensors = [self._input("input_ids", ids, "INT32"),
                       self._input("input_lengths", [len(ids)], "INT32"),
                       self._input("request_output_len", [n], "INT32"),
                       self._input("min_tokens", [n], "INT32"),
                       self._input("streaming", [True], "BOOL"),
                       self._input("return_num_output_tokens", [True], "BOOL")]
        else:
            tensors = [self._input("text_input", [text.encode("utf-8")], "BYTES"),
                       self._input("max_tokens", [n], "INT32"),
                       self._input("min_tokens", [n], "INT32"),
                       self._input("stream", [True], "BOOL")]
        with self._lock:
            self._counter += 1
            request_id = f"engine-level-{self._counter}"
        self._client.async_stream_infer(self.model, tensors, request_id=request_id,
                                        enable_empty_final_response=True, outputs=self._outputs)
        return request_id

    def _collect(self, request_ids: set[str], max_tokens: int | None = None
                 ) -> dict[str, list[float]]:
        """Arrival time of every generated token, per request, until all are final."""
        times: dict[str, list[float]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        deadline = time.monotonic() + TIMEOUT_S
        while pending:
            now, rid, count, final, error = self._events.get(
                timeout=max(1.0, deadline - time.monotonic()))
            if error is not None:
                raise RuntimeError(f"{self.model}: {error}")
            if rid not in times:
                continue
            new = count - len(times[rid])
            times[rid].extend([now] * max(0, new))
            if final:
                pending.discard(rid)
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
        try:
            self._client.stop_stream(cancel_requests=True)
        finally:
            self._client.close()

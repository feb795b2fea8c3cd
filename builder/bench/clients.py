"""Clients the load generator drives: gRPC streaming (tritonclient) and HTTP generate[_stream]
(the OpenAI endpoint's client is in `openai_client`, what both share in `client_base`).

Each client owns one connection (one gRPC stream) and sends one request at a time; the load
generator runs one client per concurrent slot. Timestamps are taken with `time.perf_counter` the
moment a response arrives (in tritonclient's callback thread for gRPC), never after parsing.
"""
from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from builder.bench.client_base import Client, SseHttpClient, new_record
from builder.bench.records import RequestRecord
from builder.client.grpc_stream import GrpcStream, StreamError, infer_inputs
from builder.bench.workloads import WorkItem

_NUMPY_DTYPES = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
                 "BOOL": np.bool_, "FP32": np.float32}


@dataclass(frozen=True)
class ModelInputs:
    """The model's declared inputs (name -> (datatype, has batch dim)), from its metadata."""

    inputs: dict[str, tuple[str, bool]]

    def accepts(self, name: str) -> bool:
        return name in self.inputs


def fetch_model_inputs(url: str, model: str, protocol: str, timeout: float = 10.0) -> ModelInputs:
    """Ask the server which inputs `model` takes (so optional ones are sent only when accepted)."""
    if protocol == "openai":
        from builder.bench.openai_client import ACCEPTED, served_models

        served = served_models(url, timeout)
        if model not in served:
            raise ValueError(f"--model {model!r}: not served at {url} (served: {served})")
        return ModelInputs(dict(ACCEPTED))
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(url) as client:
            meta = client.get_model_metadata(model, as_json=True, client_timeout=timeout)
    else:
        with urllib.request.urlopen(f"http://{url}/v2/models/{model}", timeout=timeout) as resp:
            meta = json.loads(resp.read())
    return ModelInputs({i["name"]: (i["datatype"], len(i["shape"]) > 1) for i in meta["inputs"]})


def request_fields(item: WorkItem, inputs: ModelInputs, fixed_output: bool) -> dict[str, Any]:
    """The tensors of one request. Fixed output length sends `min_tokens` == `max_tokens` so every
    request generates exactly `max_tokens` tokens (ignore_eos style) and servers compare fairly."""
    fields: dict[str, Any] = {"text_input": item.prompt, "max_tokens": item.max_tokens,
                              "stream": item.stream}
    if fixed_output and inputs.accepts("min_tokens"):
        fields["min_tokens"] = item.max_tokens
    # Count only generated tokens, and let the server say how many it generated.
    for flag in ("exclude_input_in_output", "return_num_output_tokens"):
        fields[flag] = True
    return {k: v for k, v in fields.items() if inputs.accepts(k)}


class GrpcStreamClient:
    """One gRPC stream (decoupled models need the streaming API even unstreamed)."""

    def __init__(self, url: str, model: str, inputs: ModelInputs, fixed_output: bool,
                 timeout_s: float) -> None:
        self._model, self._inputs = model, inputs
        self._fixed_output, self._timeout_s = fixed_output, timeout_s
        self._stream = GrpcStream(url)

    def _arrays(self, item: WorkItem) -> dict[str, np.ndarray]:
        arrays = {}
        for name, value in request_fields(item, self._inputs, self._fixed_output).items():
            datatype, batched = self._inputs.inputs[name]
            if datatype == "BYTES":
                value = value.encode("utf-8")
            arrays[name] = np.array(value, dtype=_NUMPY_DTYPES[datatype]).reshape(
                [1, 1] if batched else [1])
        return arrays

    def send(self, item: WorkItem, index: int, level_start: float) -> RequestRecord:
        record = new_record(item, index)
        request_id = f"bench-{index}"
        tensors = infer_inputs(self._arrays(item))
        sent = time.perf_counter()
        record.start = sent - level_start
        try:
            self._stream.send(self._model, tensors, request_id)
            for response in self._stream.responses(request_id, self._timeout_s,
                                                   deadline=sent + self._timeout_s):
                record.add_chunk(response.arrived - sent, _text(response.output("text_output")))
                record.note_server_tokens(_int(response.output("num_output_tokens")))
                if response.final:
                    record.end = response.arrived - sent
        except TimeoutError:
            record.cancelled, record.error = True, f"timeout after {self._timeout_s:g}s"
        except StreamError as exc:
            record.error = str(exc)
        except Exception as exc:  # tritonclient raises its own exception types for a dead stream
            record.error = f"{type(exc).__name__}: {exc}"
        if record.error is not None:
            self._stream.restart()  # the stream may be broken; a fresh one costs little
        return record

    def close(self) -> None:
        self._stream.close()


def _text(array: np.ndarray | None) -> str:
    if array is None:
        return ""
    return "".join(v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                   for v in array.reshape(-1))


def _int(array: Any) -> int | None:
    if array is None:
        return None
    if isinstance(array, np.ndarray):
        return int(array.reshape(-1)[0]) if array.size else None
    if isinstance(array, list):
        return _int(np.array(array))
    return int(array)


class HttpGenerateClient(SseHttpClient):
    """Triton's HTTP generate extension: `generate_stream` (SSE) or `generate` (one JSON)."""

    def __init__(self, url: str, model: str, inputs: ModelInputs, fixed_output: bool,
                 timeout_s: float) -> None:
        super().__init__(url, timeout_s)
        self._model, self._inputs, self._fixed_output = model, inputs, fixed_output

    def _request(self, item: WorkItem) -> tuple[str, dict[str, Any]]:
        endpoint = "generate_stream" if item.stream else "generate"
        return (f"/v2/models/{self._model}/{endpoint}",
                request_fields(item, self._inputs, self._fixed_output))

    def _take(self, payload: dict, record: RequestRecord, elapsed: float) -> None:
        if "error" in payload:
            record.error = str(payload["error"])
            return
        text = payload.get("text_output", "")
        record.add_chunk(elapsed, "".join(text) if isinstance(text, list) else str(text))
        record.note_server_tokens(_int(payload.get("num_output_tokens")))


def make_client(protocol: str, url: str, model: str, inputs: ModelInputs, fixed_output: bool,
                timeout_s: float) -> Client:
    if protocol == "grpc":
        return GrpcStreamClient(url, model, inputs, fixed_output, timeout_s)
    if protocol == "http":
        return HttpGenerateClient(url, model, inputs, fixed_output, timeout_s)
    if protocol == "openai":
        from builder.bench.openai_client import OpenAICompletionsClient

        return OpenAICompletionsClient(url, model, fixed_output and inputs.accepts("min_tokens"),
                                       timeout_s)
    raise ValueError(f"protocol must be grpc, http or openai, got {protocol!r}")

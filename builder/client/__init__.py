"""A small client for the emitted repository, on `tritonclient`'s gRPC streaming and on Triton's
HTTP `generate` / `generate_stream` endpoints. Used by `forge query`, `make demo` and the tests.

Inputs are given with the ensemble's names (`text_input`, `max_tokens`, `stream`, `top_k`, ...);
`text_inputs()` turns keyword values into typed arrays with the contract's dtypes.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

import numpy as np

from builder.client.grpc_stream import GrpcStream, StreamError, infer_inputs

# The ensemble / BLS inputs and their numpy dtypes (the contract table in docs/triton-contract.md).
INPUT_DTYPES = {
    "text_input": np.object_, "max_tokens": np.int32, "bad_words": np.object_,
    "stop_words": np.object_, "exclude_input_in_output": np.bool_, "end_id": np.int32,
    "pad_id": np.int32, "top_k": np.int32, "top_p": np.float32, "temperature": np.float32,
    "length_penalty": np.float32, "repetition_penalty": np.float32, "min_tokens": np.int32,
    "presence_penalty": np.float32, "frequency_penalty": np.float32, "seed": np.uint64,
    "return_log_probs": np.bool_, "return_perf_metrics": np.bool_,
    "return_num_input_tokens": np.bool_, "return_num_output_tokens": np.bool_,
    "beam_width": np.int32, "stream": np.bool_, "num_return_sequences": np.int32,
    "apply_chat_template": np.bool_, "timeout_ms": np.uint64, "priority": np.int32,
    "guided_decoding_guide_type": np.object_, "guided_decoding_guide": np.object_,
    "lora_task_id": np.uint64,
}
LIST_INPUTS = ("bad_words", "stop_words")


def text_inputs(**values) -> dict[str, np.ndarray]:
    """Typed [1, n] arrays for the given ensemble inputs (None values are left out)."""
    arrays = {}
    for name, value in values.items():
        if value is None:
            continue
        dtype = INPUT_DTYPES.get(name)
        if dtype is None:
            raise ValueError(f"{name}: not an input of the ensemble (known: {sorted(INPUT_DTYPES)})")
        items = list(value) if name in LIST_INPUTS else [value]
        if dtype is np.object_:
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
        arrays[name] = np.array([items], dtype=dtype)
    return arrays


def decode_text(outputs: dict) -> str:
    value = outputs["text_output"].reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def stream_grpc(url: str, model: str, inputs: dict[str, np.ndarray], request_id: str = "",
                timeout: float = 120.0, headers: dict[str, str] | None = None,
                request_timeout_us: int = 0) -> Iterator[dict]:
    """Stream one request over gRPC; yields each response's outputs; raises `RuntimeError` with
    the server's message on an error response. `timeout`: the longest wait for a response;
    `request_timeout_us`: Triton's own request timeout (0: none), a deadline the models honour.

    `headers` go out as the stream's gRPC metadata (e.g. `x-llm-forge-client`).

    The stream is closed (and the request cancelled if still running) when the caller stops
    iterating early.
    """
    stream = GrpcStream(url, headers, check_live=True)
    finished = False
    try:
        stream.send(model, infer_inputs(inputs), request_id, request_timeout_us)
        for response in stream.responses(request_id, timeout):
            finished = response.final
            if response.result.get_response().outputs:
                yield response.outputs()
    except StreamError as exc:
        finished = True
        raise RuntimeError(str(exc)) from None
    finally:
        stream.close(cancel=not finished)


def not_reachable(url: str, reason: object) -> ConnectionError:
    """The one wording of every protocol's "nothing answers at `url`" (gRPC's is in grpc_stream)."""
    return ConnectionError(f"{url}: server not reachable ({reason})")


def generate_http(url: str, model: str, payload: dict, stream: bool = False,
                  timeout: float = 120.0) -> list[dict]:
    """POST to /generate (one JSON object) or /generate_stream (server-sent events); raises
    `RuntimeError` with the server's message, or `ConnectionError` when nothing answers."""
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(exc.read().decode("utf-8", errors="replace")) from None
    except urllib.error.URLError as exc:  # no answer at all: refused, unknown host, timeout
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) else exc.reason
        raise not_reachable(url, reason or exc.reason) from None
    if not stream:
        return [json.loads(body)]
    events = [json.loads(line[len("data:"):]) for line in body.splitlines()
              if line.startswith("data:")]
    for event in events:
        if "error" in event:
            raise RuntimeError(event["error"])
    return events

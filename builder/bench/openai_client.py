"""The load generator's client for the OpenAI-compatible endpoint (`forge serve --openai-port`).

It sends each workload item to `/v1/completions` (the raw prompt, as the Triton-native clients
send it to the ensemble, so both paths run the same tokens) over one keep-alive HTTP connection,
streamed as server-sent events when the item streams. Timestamps are taken when each event's line
arrives. The token count is the server's `usage.completion_tokens` (streams ask for it with
`stream_options.include_usage`).
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from typing import Any

from builder.bench.records import RequestRecord
from builder.bench.workloads import WorkItem

# What /v1/completions takes that the load generator may send (see `clients.request_fields`).
ACCEPTED = {"text_input": ("BYTES", False), "max_tokens": ("INT32", False),
            "min_tokens": ("INT32", False), "stream": ("BOOL", False)}


def served_models(url: str, timeout: float = 10.0) -> list[str]:
    """The model ids `GET /v1/models` lists at `url` (host:port)."""
    with urllib.request.urlopen(f"http://{url}/v1/models", timeout=timeout) as reply:
        return [model["id"] for model in json.loads(reply.read())["data"]]


def completion_body(item: WorkItem, model: str, fixed_output: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": item.prompt,
                            "max_tokens": item.max_tokens, "stream": item.stream}
    if fixed_output:
        body["min_tokens"] = item.max_tokens  # every request generates exactly max_tokens
    if item.stream:
        body["stream_options"] = {"include_usage": True}
    return body


class OpenAICompletionsClient:
    def __init__(self, url: str, model: str, fixed_output: bool, timeout_s: float) -> None:
        host, _, port = url.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._model, self._fixed_output, self._timeout_s = model, fixed_output, timeout_s
        self._conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def send(self, item: WorkItem, index: int, level_start: float) -> RequestRecord:
        record = RequestRecord(index=index, max_tokens=item.max_tokens, stream=item.stream,
                               num_input_tokens=item.num_input_tokens)
        body = json.dumps(completion_body(item, self._model, self._fixed_output))
        sent = time.perf_counter()
        record.start = sent - level_start
        try:
            self._conn.request("POST", "/v1/completions", body=body,
                               headers={"Content-Type": "application/json"})
            response = self._conn.getresponse()
            if response.status != 200:
                payload = json.loads(response.read() or b"{}")
                record.error = f"HTTP {response.status}: {payload.get('error', payload)}"
            elif item.stream:
                self._read_events(response, record, sent)
            else:
                self._take(json.loads(response.read()), record, time.perf_counter() - sent)
            if record.error is None:
                record.end = time.perf_counter() - sent
        except TimeoutError:
            record.cancelled, record.error = True, f"timeout after {self._timeout_s:g}s"
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        if record.error is not None:  # the connection's state is unknown: start afresh
            self._conn.close()
            self._conn = self._connect()
        return record

    def _read_events(self, response: http.client.HTTPResponse, record: RequestRecord,
                     sent: float) -> None:
        while True:
            line = response.readline()
            arrived = time.perf_counter()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                response.read()  # the end of the chunked body, so the connection is reusable
                return
            self._take(json.loads(data), record, arrived - sent)
            if record.error is not None:
                response.read()
                return

    @staticmethod
    def _take(payload: dict, record: RequestRecord, elapsed: float) -> None:
        if "error" in payload:
            record.error = str(payload["error"].get("message", payload["error"]))
            return
        for choice in payload.get("choices") or []:
            record.add_chunk(elapsed, choice.get("text") or "")
        if payload.get("usage"):
            record.note_server_tokens(payload["usage"]["completion_tokens"])

    def close(self) -> None:
        self._conn.close()

"""The load generator's client for the OpenAI-compatible endpoint (`forge serve --openai-port`).

It sends each workload item to `/v1/completions` (the raw prompt, as the Triton-native clients
send it to the ensemble, so both paths run the same tokens) over one keep-alive HTTP connection,
streamed as server-sent events when the item streams. Timestamps are taken when each event's line
arrives. The token count is the server's `usage.completion_tokens` (streams ask for it with
`stream_options.include_usage`).
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any

from builder.bench.client_base import SseHttpClient
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


class OpenAICompletionsClient(SseHttpClient):
    def __init__(self, url: str, model: str, fixed_output: bool, timeout_s: float) -> None:
        super().__init__(url, timeout_s)
        self._model, self._fixed_output = model, fixed_output

    def _request(self, item: WorkItem) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", completion_body(item, self._model, self._fixed_output)

    def _take(self, payload: dict, record: RequestRecord, elapsed: float) -> None:
        if "error" in payload:
            error = payload["error"]
            record.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        for choice in payload.get("choices") or []:
            record.add_chunk(elapsed, choice.get("text") or "")
        if payload.get("usage"):
            record.note_server_tokens(payload["usage"]["completion_tokens"])

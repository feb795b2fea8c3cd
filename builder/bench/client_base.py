"""What every client of the load generator shares: the `Client` protocol, a request's empty
record, and `SseHttpClient`, the keep-alive HTTP client under Triton's generate extension
(`clients.HttpGenerateClient`) and the OpenAI endpoint's client (`openai_client`)."""
from __future__ import annotations

import http.client
import json
import time
from typing import Any, Protocol

from builder.bench.records import RequestRecord
from builder.bench.workloads import WorkItem


class Client(Protocol):
    def send(self, item: WorkItem, index: int, level_start: float) -> RequestRecord: ...

    def close(self) -> None: ...


def new_record(item: WorkItem, index: int) -> RequestRecord:
    return RequestRecord(index=index, max_tokens=item.max_tokens, stream=item.stream,
                         num_input_tokens=item.num_input_tokens)


class SseHttpClient:
    """One keep-alive HTTP connection; a request is a JSON POST answered by one JSON body or, when
    the item streams, by server-sent events (`data:` lines, an optional `data: [DONE]` last).
    Subclasses say where and what to POST and how to read one payload (`_take`)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        host, _, port = url.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._timeout_s = timeout_s
        self._conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def _request(self, item: WorkItem) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one item."""
        raise NotImplementedError

    def _take(self, payload: dict, record: RequestRecord, elapsed: float) -> None:
        """Add one response payload (a whole body or one event) to `record`."""
        raise NotImplementedError

    def send(self, item: WorkItem, index: int, level_start: float) -> RequestRecord:
        record = new_record(item, index)
        path, body = self._request(item)
        sent = time.perf_counter()
        record.start = sent - level_start
        try:
            self._conn.request("POST", path, body=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = self._conn.getresponse()
            if response.status != 200:
                payload = json.loads(response.read() or b"{}")
                self._take(payload, record, time.perf_counter() - sent)
                record.error = f"HTTP {response.status}: {record.error or payload}"
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
            arrived = time.perf_counter()  # when the event's line arrived, before parsing
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

    def close(self) -> None:
        self._conn.close()

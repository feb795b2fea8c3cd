"""What Triton 2.51's HTTP `generate` answers to JSON of the wrong type, and the log-prob
outputs through the ensemble, on a real server.

A JSON value that does not convert to an input's datatype never reaches our models: Triton's
HTTP frontend refuses it itself, with status 400 or 500 and a message of its own that may not
name the input (docs/triton-contract.md, "Errors"). Over gRPC the same values are typed arrays
and get our error naming the field (tests/e2e/test_bad_input_corpus.py).
"""
import json
import urllib.error
import urllib.request

import pytest

from builder.client import generate_http
from builder.repository import RepositoryOptions, emit_repository
from tests.triton_helpers import build_tiny_engine, running_tritonserver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("http-types"))
    repo = emit_repository(engine_dir, engine_dir.parent.parent / "repo", RepositoryOptions())
    with running_tritonserver(repo, ready_timeout=600) as running:  # a busy host loads slowly
        yield running


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("body", [
    {"text_input": "The quick brown fox", "max_tokens": "many"},
    {"text_input": "The quick brown fox", "max_tokens": 1.5},
    {"text_input": 123, "max_tokens": 4},
], ids=["max_tokens-string", "max_tokens-float", "text_input-number"])
def test_wrong_json_types_are_refused_by_triton_and_the_server_serves_on(server, body):
    status, text = _post(server.http_url, body)
    print(f"{json.dumps(body)} -> {status} {text}")  # the record behind the docs' statement
    assert status in (400, 500) and "error" in json.loads(text)
    reply = generate_http(server.http_url, "ensemble", {"text_input": "The quick", "max_tokens": 2})
    assert reply[0]["text_output"]


def test_log_probs_through_the_ensemble_follow_return_log_probs(server):
    base = {"text_input": "The quick brown fox", "max_tokens": 4}
    asked = generate_http(server.http_url, "ensemble", {**base, "return_log_probs": True})[0]
    silent = generate_http(server.http_url, "ensemble", base)[0]
    per_token = asked["output_log_probs"]
    assert len(per_token) == 4 and all(p <= 0 for p in per_token) and min(per_token) < 0
    assert asked["cum_log_probs"][0] == pytest.approx(sum(per_token), abs=1e-4)
    assert silent["cum_log_probs"] == [0.0] and set(silent["output_log_probs"]) == {0.0}

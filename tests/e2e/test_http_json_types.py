"""What Triton 2.51's HTTP `generate` answers to JSON of the wrong type, a request without
`max_tokens` on every protocol, and the log-prob outputs through the ensemble, on a real server.

A JSON value that does not convert to an input's datatype never reaches our models: Triton's
HTTP frontend refuses it itself, with status 400 or 500 and a message of its own that may not
name the input (docs/triton-contract.md, "Errors"). Over gRPC the same values are typed arrays
and get our error naming the field (tests/e2e/test_bad_input_corpus.py).
"""
import json
import urllib.error
import urllib.request

import pytest

from builder.client import generate_http, stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
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


NOT_SIGNED = "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"
NOT_STRING = "Unable to parse JSON bytes array: attempt to access JSON non-string as string"


@pytest.mark.parametrize("body, error", [
    ({"text_input": "The quick brown fox", "max_tokens": "many"}, NOT_SIGNED),
    ({"text_input": "The quick brown fox", "max_tokens": 1.5}, NOT_SIGNED),
    ({"text_input": 123, "max_tokens": 4}, NOT_STRING),
], ids=["max_tokens-string", "max_tokens-float", "text_input-number"])
def test_wrong_json_types_are_refused_by_triton_and_the_server_serves_on(server, body, error):
    """Triton 2.51's own frontend converts the JSON before any model runs: a 500 whose text does
    not name the input (docs/triton-contract.md says so); gRPC and the OpenAI API name it."""
    status, text = _post(server.http_url, body)
    assert (status, json.loads(text)) == (500, {"error": error})
    reply = generate_http(server.http_url, "ensemble", {"text_input": "The quick", "max_tokens": 2})
    assert reply[0]["text_output"]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_request_without_max_tokens_is_told_so_on_http_and_grpc(server, model):
    """`max_tokens` is declared optional so that Triton lets the request reach the model that
    names it: not Triton's "expected number of inputs between 2 and 31" (BLS), nor an ensemble
    stream that ends without a response."""
    for stream in (False, True):
        with pytest.raises(RuntimeError, match="max_tokens is required"):
            generate_http(server.http_url, model, {"text_input": "The quick"}, stream=stream)
        with pytest.raises(RuntimeError, match="max_tokens is required"):
            list(stream_grpc(server.grpc_url, model, text_inputs(text_input="The quick",
                                                                  stream=stream)))
    reply = generate_http(server.http_url, model, {"text_input": "The quick", "max_tokens": 2})
    assert reply[0]["text_output"]


def test_log_probs_through_the_ensemble_follow_return_log_probs(server):
    base = {"text_input": "The quick brown fox", "max_tokens": 4}
    asked = generate_http(server.http_url, "ensemble", {**base, "return_log_probs": True})[0]
    silent = generate_http(server.http_url, "ensemble", base)[0]
    per_token = asked["output_log_probs"]
    assert len(per_token) == 4 and all(p <= 0 for p in per_token) and min(per_token) < 0
    # Triton's generate endpoint gives a one-element output as a plain number
    assert asked["cum_log_probs"] == pytest.approx(sum(per_token), abs=1e-4)
    assert silent["cum_log_probs"] == 0.0 and set(silent["output_log_probs"]) == {0.0}

"""OpenAI requests cut by the drain end with a retryable error that says the server is draining:
`forge serve --openai-port` on a tiny engine, requests that cannot finish within the drain
timeout, then SIGTERM. A stream ends with an error event (service_unavailable, "the server is
draining"); a non-streamed request gets a 503 with Retry-After, which the official client
retries. Through the default path (tensorrt_llm, token ids) and through the ensemble, which
ends the cut request with a `cancelled` final instead of an error (serving_control.py)."""
from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.serve import free_port
from tests.triton_helpers import ForgeServe, build_tiny_engine

pytestmark = pytest.mark.slow
DRAINING = "the server is draining"


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """Room for 3500 new tokens: a request cannot end on its own within the drain timeout."""
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("drained"), max_seq_len=4096,
                                   max_input_len=256, kv_cache_num_blocks=320)
    return emit_repository(engine_dir, engine_dir.parent.parent / "repo",
                           RepositoryOptions(stats_period_ms=20))


def _streamed(client: openai.OpenAI, started: threading.Event) -> tuple[int, Exception | None]:
    chunks = 0
    try:
        for _ in client.completions.create(model="tiny", prompt="The quick brown fox",
                                           max_tokens=3500, stream=True, temperature=0):
            chunks += 1
            started.set()
    except Exception as exc:  # the one we expect: the error event
        return chunks, exc
    return chunks, None


def _whole(client: openai.OpenAI) -> Exception | None:
    try:
        client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=3500,
                                  temperature=0)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("triton_model", ["tensorrt_llm", "ensemble"])
def test_requests_cut_by_the_drain_end_with_a_retryable_draining_error(repository, monkeypatch,
                                                                       triton_model):
    monkeypatch.setenv("LLM_FORGE_KERNELS", "torch")
    port = free_port()
    serve = ForgeServe(repository, "--openai-port", str(port), "--drain-timeout", "3",
                       "--openai-triton-model", triton_model)
    try:
        serve.wait_serving()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        started = threading.Event()
        results: dict[str, object] = {}
        threads = [threading.Thread(target=lambda: results.update(stream=_streamed(client,
                                                                                    started))),
                   threading.Thread(target=lambda: results.update(whole=_whole(client)))]
        for thread in threads:
            thread.start()
        assert started.wait(60), serve.text()
        time.sleep(0.5)  # the non-streamed one is in the engine too
        serve.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert serve.process.wait(90) == 0, serve.text()
    finally:
        serve.close()
    chunks, error = results["stream"]
    assert chunks > 0 and isinstance(error, openai.APIError), (chunks, error)
    assert DRAINING in error.message and error.body["code"] == "service_unavailable", error.body
    whole = results["whole"]
    assert isinstance(whole, openai.InternalServerError), whole
    assert whole.status_code == 503 and whole.response.headers["retry-after"] == "1"
    assert DRAINING in whole.message and "send it again" in whole.message, whole.message
    print(f"\n{triton_model}: the stream ended after {chunks} chunks with {error.message!r}; "
          f"the non-streamed request got 503 Retry-After 1: {whole.message!r}")

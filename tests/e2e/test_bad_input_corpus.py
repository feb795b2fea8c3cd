"""The bad-input corpus: malformed requests over gRPC (streaming and not), HTTP `generate` and
`generate_stream`, on `ensemble`, `tensorrt_llm_bls` and `tensorrt_llm`, each answered with an
error naming the field; after each one a normal request is served. One server for the module.

Cases marked `reliability=True` exercise the request checks of the reliability work (ranges of
temperature and penalties, min_tokens <= max_tokens, end_id in the vocabulary, word-list sizes).
"""
import math

import numpy as np
import pytest

from builder.client import generate_http, stream_grpc, text_inputs
from builder.repository.emit import RepositoryOptions, emit_repository
from tests.triton_helpers import build_tiny_engine, running_tritonserver

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"
NAN, INF = math.nan, math.inf


def case(id, values, match, http=True, raw=None, reliability=False):
    """`reliability` only documents which checks a case exercises (see the module doc)."""
    return pytest.param(values, raw or {}, match, http, id=id)


# text models (ensemble, tensorrt_llm_bls): (values for gRPC and the HTTP JSON body, raw gRPC
# arrays that replace or add inputs, the error pattern, whether HTTP can carry it)
TEXT_CASES = [
    case("max_tokens-zero", {"max_tokens": 0}, "max_tokens must be >= 1"),
    case("max_tokens-negative", {"max_tokens": -5}, "max_tokens must be >= 1"),
    case("max_tokens-int32-max", {"max_tokens": 2**31 - 1}, "max_tokens .* max_seq_len 1024"),
    case("max_tokens-overflow", {"max_tokens": 2**40}, "max_tokens", http=True,
         raw={"max_tokens": np.array([[2**40]], np.int64)}),
    case("max_tokens-missing", {"max_tokens": None}, "max_tokens", http=True),
    case("max_tokens-float-dtype", {}, "max_tokens", http=False,
         raw={"max_tokens": np.array([[8.5]], np.float32)}),
    case("max_tokens-wrong-shape", {}, "max_tokens", http=False,
         raw={"max_tokens": np.array([[8, 9, 10]], np.int32)}),
    case("max_tokens-string", {"max_tokens": "eight"}, "max_tokens", http=False,
         raw={"max_tokens": np.array([[b"eight"]], np.object_)}),
    case("text_input-missing", {"text_input": None}, "text_input", http=True),
    case("text_input-too-many-tokens", {"text_input": "fox " * 100}, "max_input_len 64"),
    case("text_input-one-megabyte", {"text_input": "a" * (1 << 20)}, "text_input"),
    case("text_input-invalid-utf8", {"text_input": b"caf\xc3 \xff"},
         "text_input is not valid UTF-8", http=False),
    case("text_input-int-dtype", {}, "text_input", http=False,
         raw={"text_input": np.array([[1, 2]], np.int32)}),
    case("text_input-batch-2", {}, "text_input|batch", http=False,
         raw={"text_input": np.array([[b"a"], [b"b"]], np.object_)}),
    case("temperature-nan", {"temperature": NAN}, "temperature", http=False),
    case("temperature-inf", {"temperature": INF}, "temperature", http=False),
    case("temperature-negative", {"temperature": -1.0}, "temperature"),
    case("temperature-string", {"temperature": "hot"}, "temperature", http=False,
         raw={"temperature": np.array([[b"hot"]], np.object_)}),
    case("temperature-too-small", {"temperature": 0.001}, "temperature", reliability=True),
    case("top_p-zero", {"top_p": 0.0}, "top_p"),
    case("top_p-above-one", {"top_p": 1.5}, "top_p"),
    case("top_p-nan", {"top_p": NAN}, "top_p", http=False),
    case("top_k-negative", {"top_k": -1}, "top_k"),
    case("repetition_penalty-zero", {"repetition_penalty": 0.0}, "repetition_penalty"),
    case("repetition_penalty-huge", {"repetition_penalty": 1e6}, "repetition_penalty",
         reliability=True),
    case("presence_penalty-inf", {"presence_penalty": INF}, "presence_penalty", http=False),
    case("frequency_penalty-nan", {"frequency_penalty": NAN}, "frequency_penalty", http=False),
    case("frequency_penalty-huge", {"frequency_penalty": 1e9}, "frequency_penalty",
         reliability=True),
    case("min_tokens-negative", {"min_tokens": -1}, "min_tokens"),
    case("min_tokens-over-max_tokens", {"min_tokens": 50}, "min_tokens", reliability=True),
    case("beam_width-two", {"beam_width": 2}, "beam_width must be 1"),
    case("beam_width-negative", {"beam_width": -1}, "beam_width"),
    case("num_return_sequences-three", {"num_return_sequences": 3}, "num_return_sequences"),
    case("length_penalty-two", {"length_penalty": 2.0}, "len_penalty"),
    case("end_id-outside-vocab", {"end_id": 10**6}, "end_id", reliability=True),
    case("seed-negative-dtype", {}, "seed", http=False,
         raw={"seed": np.array([[-1]], np.int64)}),
    case("stop_words-10000", {"stop_words": ["fox"] * 10_000}, "stop_words", reliability=True),
    case("bad_words-10000", {"bad_words": ["dog"] * 10_000}, "bad_words", reliability=True),
    case("stop_words-invalid-utf8", {"stop_words": [b"\xff\xfe"]}, "stop_words", http=False),
    case("unknown-input", {}, "no_such_input", http=False,
         raw={"no_such_input": np.array([[1]], np.int32)}),
    case("apply_chat_template-without-template", {"apply_chat_template": True},
         "apply_chat_template"),
    case("return_log_probs-string", {"return_log_probs": "yes"}, "return_log_probs", http=False,
         raw={"return_log_probs": np.array([[b"yes"]], np.object_)}),
    case("timeout_ms-over-a-day", {"timeout_ms": 86_400_001},
         r"timeout_ms must be an integer in \[0, 86400000\] \(0: no deadline\), got 86400001"),
    case("timeout_ms-negative-dtype", {}, "timeout_ms", http=False,
         raw={"timeout_ms": np.array([[-1]], np.int64)}),
    case("priority-over", {"priority": 101}, r"priority must be an integer in \[-100, 100\], got 101"),
    case("priority-under", {"priority": -1000},
         r"priority must be an integer in \[-100, 100\], got -1000"),
    case("priority-float-dtype", {}, "priority", http=False,
         raw={"priority": np.array([[1.5]], np.float32)}),
    case("guide-type-unknown", {"guided_decoding_guide_type": "yaml",
                                "guided_decoding_guide": "a: 1"},
         "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar, "
         "got 'yaml'"),
    case("guide-without-type", {"guided_decoding_guide": "a+"},
         "guided_decoding_guide needs guided_decoding_guide_type"),
    case("guide-regex-does-not-compile", {"guided_decoding_guide_type": "regex",
                                          "guided_decoding_guide": "(a"},
         "guided_decoding_guide: invalid regex: at 1"),
    case("guide-schema-not-json", {"guided_decoding_guide_type": "json_schema",
                                   "guided_decoding_guide": "{not json"},
         "guided_decoding_guide: the json_schema is not valid JSON"),
    case("guide-schema-invalid", {"guided_decoding_guide_type": "json_schema",
                                  "guided_decoding_guide": '{"type": "foo"}'},
         "guided_decoding_guide: invalid json_schema: Invalid type: foo"),
    case("guide-over-the-size-limit", {"guided_decoding_guide_type": "ebnf_grammar",
                                       "guided_decoding_guide": 'root ::= "' + "a" * 70_000 + '"'},
         "guided_decoding_guide has 70011 characters, over the limit of 65536"),
]


def ids(*values, dtype=np.int32):
    return np.array([list(values)], dtype)


# tensorrt_llm (token level, gRPC): inputs added to / replacing a valid request
LLM_CASES = [
    case("input_ids-empty", {"input_ids": np.zeros((1, 0), np.int32),
                             "input_lengths": ids(0)}, "input_ids"),
    case("input_ids-outside-vocab", {"input_ids": ids(5, 10**6)},
         r"input_ids: token id 1000000 is outside the vocabulary"),
    case("input_ids-negative", {"input_ids": ids(-4, 5)}, "input_ids: token id -4"),
    case("input_ids-float-dtype", {"input_ids": np.array([[5.0, 6.0]], np.float32)}, "input_ids"),
    case("input_ids-batch-2", {"input_ids": np.array([[5, 6], [7, 8]], np.int32)},
         "input_ids|batch"),
    case("input_ids-over-max_input_len", {"input_ids": ids(*[5] * 100),
                                          "input_lengths": ids(100)}, "max_input_len 64"),
    case("input_lengths-over", {"input_lengths": ids(9)}, "input_lengths"),
    case("input_lengths-negative", {"input_lengths": ids(-1)}, "input_lengths"),
    case("request_output_len-zero", {"request_output_len": ids(0)}, "request_output_len"),
    case("request_output_len-int32-max", {"request_output_len": ids(2**31 - 1)},
         "request_output_len .* max_seq_len"),
    case("request_output_len-missing", {"request_output_len": None}, "request_output_len"),
    case("stop_words_list-bad-shape", {"stop_words_list": np.zeros((1, 3, 2), np.int32)},
         "stop_words_list"),
    case("stop_words_list-bad-offsets", {"stop_words_list": np.array([[[5, 6], [2, 1]]],
                                                                      np.int32)},
         "stop_words_list: offsets"),
    case("bad_words_list-outside-vocab", {"bad_words_list": np.array([[[10**6], [1]]],
                                                                      np.int32)},
         "bad_words_list: token id 1000000"),
    case("temperature-nan", {"temperature": np.array([[NAN]], np.float32)}, "temperature"),
    case("runtime_top_p-zero", {"runtime_top_p": np.array([[0.0]], np.float32)},
         "runtime_top_p"),
    case("runtime_top_k-negative", {"runtime_top_k": ids(-3)}, "runtime_top_k"),
    case("seed-int32-dtype", {"seed": ids(7)}, "seed"),
    case("beam_width-four", {"beam_width": ids(4)}, "beam_width must be 1"),
    case("end_id-outside-vocab", {"end_id": ids(10**6)}, "end_id", reliability=True),
    case("min_tokens-over-request_output_len", {"min_tokens": ids(50)}, "min_tokens",
         reliability=True),
    case("stop_words_list-10000", {"stop_words_list": np.stack([np.stack([
        np.full(10_000, 5, np.int32), np.arange(1, 10_001, dtype=np.int32)])])},
         "stop_words_list", reliability=True),
    case("timeout_ms-over-a-day", {"timeout_ms": np.array([[86_400_001]], np.uint64)},
         r"timeout_ms must be an integer in \[0, 86400000\]"),
    case("priority-over", {"priority": ids(101)},
         r"priority must be an integer in \[-100, 100\], got 101"),
    case("top_log_probs-21", {"top_log_probs": ids(21)},
         r"top_log_probs must be an integer in \[0, 20\], got 21"),
    case("guide-ebnf-undefined-rule", {
        "guided_decoding_guide_type": np.array([[b"ebnf_grammar"]], np.object_),
        "guided_decoding_guide": np.array([[b"root ::= nowhere"]], np.object_)},
         "guided_decoding_guide: invalid ebnf_grammar"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("corpus"), max_seq_len=1024)
    repo = emit_repository(engine_dir, engine_dir.parent.parent / "repo", RepositoryOptions())
    with running_tritonserver(repo) as running:
        yield running


def assert_serves(server, model):
    assert server.is_ready()
    if model == "tensorrt_llm":
        chunks = list(stream_grpc(server.grpc_url, model, valid_ids_request()))
        assert sum(c["output_ids"].size for c in chunks) == 2
    else:
        reply = generate_http(server.http_url, model, {"text_input": PROMPT, "max_tokens": 2})
        assert reply[0]["text_output"]


def valid_ids_request() -> dict:
    return {"input_ids": ids(5, 6, 7), "input_lengths": ids(3),
            "request_output_len": ids(2), "min_tokens": ids(2)}


def text_values(values: dict) -> dict:
    merged = {"text_input": PROMPT, "max_tokens": 8}
    merged.update(values)
    return {k: v for k, v in merged.items() if v is not None}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("values, raw, match, http", TEXT_CASES)
def test_text_models_refuse_naming_the_field(server, model, values, raw, match, http):
    merged = text_values(values)
    typed = {k: v for k, v in merged.items() if k not in raw}
    # A missing text_input or max_tokens reaches our models too (declared optional: Triton 2.51
    # checks required inputs by count only, and the ensemble then answered nothing at all).
    for stream in (False, True):
        inputs = text_inputs(stream=stream, **typed)
        inputs.update(raw)
        with pytest.raises(RuntimeError, match=match):
            list(stream_grpc(server.grpc_url, model, inputs))
    if http:
        payload = {k: (v.decode("latin-1") if isinstance(v, bytes) else v)
                   for k, v in merged.items()}
        for stream in (False, True):
            with pytest.raises(RuntimeError, match=match):
                generate_http(server.http_url, model, dict(payload, stream=stream), stream)
    assert_serves(server, model)


@pytest.mark.parametrize("values, raw, match, http", LLM_CASES)
def test_tensorrt_llm_refuses_naming_the_field(server, values, raw, match, http):
    for streaming in (False, True):
        inputs = dict(valid_ids_request(), streaming=np.array([[streaming]]))
        inputs.pop("min_tokens")
        for name, array in values.items():
            if array is None:
                inputs.pop(name, None)
            else:
                inputs[name] = array
        if "input_ids" in values and "input_lengths" not in values:
            inputs["input_lengths"] = ids(values["input_ids"].shape[-1])
        with pytest.raises(RuntimeError, match=match):
            list(stream_grpc(server.grpc_url, "tensorrt_llm", inputs))
    assert_serves(server, "tensorrt_llm")

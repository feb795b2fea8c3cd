"""The OpenAI endpoint's pure parts, without a server: request validation (the 400 names the
field and the rule), chat rendering, parameter mapping, Triton error classification, response
objects; and the models' `apply_chat_template` tokenization."""
import math

import pytest
from pydantic import ValidationError

from builder.serving.openai.chat import ChatRenderer, conversation
from builder.serving.openai.config import OpenAIServerConfig
from builder.serving.openai.errors import OpenAIError, from_triton
from builder.serving.openai.mapping import ensemble_values, finish_reason
from builder.serving.openai.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                             check_chat, check_completion, validation_error)
from builder.serving.openai.responses import ResponseBuilder, completion_logprobs
from triton_backend.engine.config import Limits
from triton_backend.models.request_converter import RequestError
from triton_backend.models.text_request import prompt_ids

class BosTokenizer:
    """Prepends BOS (id 0) when encoding with special tokens; its template writes BOS too."""

    chat_template, bos_token, bos_token_id = "<s>...", "<s>", 0

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, turns, add_generation_prompt, tokenize):
        return "<s>" + "".join(f"[{t['role']}] {t['content']}\n" for t in turns)


def refused(body: dict, kind=CompletionRequest) -> OpenAIError:
    try:
        request = kind.model_validate(body)
    except ValidationError as exc:
        return validation_error(exc.errors())
    with pytest.raises(OpenAIError) as info:
        (check_completion if kind is CompletionRequest else check_chat)(request)
    return info.value


@pytest.mark.parametrize("body, param, message", [
    ({"temperature": math.nan}, "temperature", "temperature: Input should be a finite number"),
    ({"temperature": 2.5}, "temperature", "temperature: Input should be less than or equal to 2"),
    ({"top_p": 0}, "top_p", "top_p: Input should be greater than 0, got 0"),
    ({"n": 0}, "n", "n must be in [1, 16], got 0"),
    ({"n": 17}, "n", "n must be in [1, 16], got 17"),
    ({"seed": -3}, "seed", "seed: Input should be greater than or equal to 0, got -3"),
    ({"stop": ["", "x"]}, "stop", "stop: stop strings must not be empty"),
    ({"stop": ["x", "\ud800"]}, "stop", "stop[1]: contains a lone UTF-16 surrogate ('\\ud800')"),
    ({"prompt": "a\udc00"}, "prompt", "prompt: contains a lone UTF-16 surrogate ('\\udc00')"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options: only allowed when stream is true"),
    ({"prompt": ["a", "b"]}, "prompt", "prompt: one prompt per request is supported, got 2"),
    ({"prompt": [1, 2, 3]}, "prompt", "prompt: token-id prompts are not supported, send text"),
    ({"echo": True}, "echo", "echo: not supported by this server"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens (9) must not exceed"),
    # Refused by name on completions as on chat, never answered 200 and ignored.
    ({"response_format": {"type": "xml"}}, "response_format",
     "response_format.type must be one of text, json_object, json_schema, got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema.schema is required for type json_schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     "guided_choice: only one structured output constraint per request, got guided_regex, "
     "guided_choice"),
    ({"tools": [{"type": "function"}]}, "tools",
     "tools: tool calling is served on /v1/chat/completions"),
    ({"functions": [{"name": "f"}]}, "functions",
     "functions: the deprecated form is not supported; send tools on /v1/chat/completions"),
])
def test_bad_completion_requests_name_the_field(body, param, message):
    error = refused({"model": "m", "prompt": "hi", **body})
    assert (error.status, error.param, error.type) == (400, param, "invalid_request_error")
    assert error.message.startswith(message)


def test_missing_fields_and_chat_only_refusals():
    error = refused({"prompt": "hi"})
    assert (error.status, error.param, error.message) == (400, "model", "model: Field required")
    error = refused({"model": "m", "messages": [{"content": "hi"}]}, ChatCompletionRequest)
    assert (error.param, error.message) == ("messages[0].role", "messages[0].role: Field required")
    error = refused({"model": "m", "messages": [], "n": 0}, ChatCompletionRequest)
    assert (error.param, error.message) == ("n", "n must be in [1, 16], got 0")


def test_conversation_checks_roles_and_content():
    turns = conversation([ChatMessage(role="developer", content="be brief"),
                          ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]),
                          ChatMessage(role="assistant", content=None)])
    assert turns == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                     {"role": "assistant", "content": ""}]
    for messages, param, message in [
            ([], "messages", "messages: must hold at least one message"),
            ([ChatMessage(role="function", content="x")], "messages[0].role",
             "messages[0].role: must be one of system, user, assistant, tool (or developer), "
             "got 'function'"),
            ([ChatMessage(role="tool", content="x")], "messages[0].tool_call_id",
             "messages[0].tool_call_id: required for role 'tool'"),
            ([ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}])],
             "messages[0].tool_calls[0]", "messages[0].tool_calls[0].function.arguments is not "
                                          "valid JSON"),
            ([ChatMessage(role="user", content=[{"type": "image_url"}])],
             "messages[0].content[0]", "messages[0].content[0]: only text parts are supported"),
            ([ChatMessage(role="user")], "messages[0].content",
             "messages[0].content: required for role 'user'")]:
        with pytest.raises(OpenAIError) as info:
            conversation(messages)
        assert info.value.param == param and info.value.message.startswith(message)


def test_chat_renderer_uses_the_template_and_drops_a_doubled_bos(tokenizer, chat_tokenizer):
    messages = [ChatMessage(role="system", content="S"), ChatMessage(role="user", content="U")]
    # The tiny tokenizer adds no BOS itself, so the template's <s> stays.
    assert ChatRenderer(chat_tokenizer, True).render(messages) == \
        "<s>[system] S\n<s>[user] U\n[assistant] "
    # A tokenizer that prepends <s> itself would double the template's: the rendered one goes.
    assert ChatRenderer(BosTokenizer(), True).render(messages) == "[system] S\n[user] U\n"
    assert ChatRenderer(BosTokenizer(), False).render(messages).startswith("<s>[system]")
    with pytest.raises(OpenAIError, match="messages: this model has no chat template") as info:
        ChatRenderer(tokenizer, True).render(messages)
    assert info.value.status == 400


def test_apply_chat_template_input_tokenizes_one_user_turn(tokenizer, chat_tokenizer):
    limits = Limits(max_batch_size=1, max_num_tokens=64, max_input_len=64, max_seq_len=128)
    ids = prompt_ids(chat_tokenizer, "hi", True, limits, apply_chat_template=True)
    assert ids == chat_tokenizer.encode("<s>[user] hi\n[assistant] ", add_special_tokens=False)
    assert prompt_ids(chat_tokenizer, "hi", True, limits) == chat_tokenizer.encode("hi")
    with pytest.raises(RequestError, match="apply_chat_template: this model's tokenizer has no "
                                           "chat template"):
        prompt_ids(tokenizer, "hi", True, limits, apply_chat_template=True)


def test_parameters_map_to_the_ensemble_inputs():
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "stop": "x", "seed": 7, "temperature": 0.5,
         "presence_penalty": 0.1, "stream": True})
    values = ensemble_values(request, "p", 12, log_probs=False)
    assert values["text_input"] == "p" and values["max_tokens"] == 12
    assert values["stop_words"] == ["x"] and values["seed"] == 7 and values["stream"] is True
    assert values["temperature"] == 0.5 and values["presence_penalty"] == 0.1
    assert values["exclude_input_in_output"] is True and values["return_log_probs"] is None
    assert values["top_p"] is None  # left out: the repository's default applies
    assert values["end_id"] is None  # every EOS id of the checkpoint
    ignoring = CompletionRequest.model_validate({"model": "m", "prompt": "p", "ignore_eos": True})
    assert ensemble_values(ignoring, "p", 12, log_probs=False)["end_id"] == -1
    assert [finish_reason(r) for r in ("end_id", "stop_words", "length")] == \
        ["stop", "stop", "length"]
    with pytest.raises(OpenAIError, match="finish reason 'cancelled'"):
        finish_reason("cancelled")


def test_the_direct_path_builds_the_tensorrt_llm_request_from_the_values(tokenizer):
    """The values become the tensorrt_llm model's inputs once, under NVIDIA's names, by the
    BLS's own function; the output-length rule refuses as the ensemble does."""
    from builder.serving.openai.direct import TextCodec, direct_request

    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "seed": 7, "top_p": 0.5, "ignore_eos": True})
    codec = TextCodec(tokenizer, Limits(max_input_len=16, max_seq_len=32))
    tensors = direct_request(codec, ensemble_values(request, "a b", 12, log_probs=True)).tensors
    assert tensors["input_ids"].tolist() == [tokenizer.encode("a b")]
    assert tensors["request_output_len"].tolist() == [[12]] and tensors["streaming"].item()
    assert tensors["runtime_top_p"].item() == 0.5 and tensors["seed"].dtype.name == "uint64"
    assert tensors["end_id"].item() == -1 and tensors["return_log_probs"].item()
    assert "top_p" not in tensors and "runtime_top_k" not in tensors and "text_input" not in tensors
    with pytest.raises(RequestError, match="max_tokens must be >= 1, got 0"):
        direct_request(codec, ensemble_values(request, "a b", 0, log_probs=False))


@pytest.mark.parametrize("message, status, param, text", [
    ("in ensemble 'ensemble', text_input has 100 tokens, over the engine's max_input_len 64",
     400, "prompt",
     "prompt has 100 tokens, over the engine's max_input_len 64"),
    ("max_tokens 5000 + 3 prompt tokens exceeds the engine's max_seq_len 1024", 400,
     "max_tokens", "max_tokens 5000 + 3 prompt tokens exceeds"),
    ("max_tokens must be >= 1, got -1", 400, "max_tokens", "max_tokens must be >= 1, got -1"),
    ("runtime_top_p (top_p) must be in (0, 1], got 0", 400, "top_p", "top_p must be in"),
    ("Exceeds maximum queue size", 429, None, "the server is busy"),
    ("in ensemble 'ensemble', server busy: 64 requests waiting (limit 64)", 429, None,
     "the server is busy: 64 requests waiting (limit 64); retry later"),
    ("server busy: 9000 prompt tokens waiting (limit 16384), this prompt adds 8000", 429, None,
     "the server is busy: 9000 prompt tokens waiting (limit 16384), this prompt adds 8000; "
     "retry later"),
    ("Request for unknown model: 'ensemble' is not found", 503, None, "the model is not ready"),
    ("the server is draining: the drain timeout (30 s) expired before this request finished; "
     "send it again", 503, None, "the server is draining: the drain timeout (30 s) expired"),
    ("in ensemble 'ensemble', the server is shutting down: new requests are refused (draining)",
     503, None, "the server is shutting down: new requests are refused (draining)"),
    ("tensorrt_llm_bls: KeyError: 'x'", 500, None, "inference failed"),
])
def test_triton_errors_are_classified_and_renamed(message, status, param, text):
    error = from_triton(message, "prompt")
    assert (error.status, error.param) == (status, param) and error.message.startswith(text)


def test_response_objects():
    builder = ResponseBuilder("chat", "chatcmpl-1", 5, "m")
    full = builder.full([builder.choice(0, "hi", "stop", None)], {"prompt_tokens": 1})
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == "hi"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert builder.choice(1, None, "tool_calls", None, [call])["message"] == {
        "role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
    chunk = builder.chunk("h", None, None, with_usage_field=True, role="assistant")
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "h"}
    assert chunk["usage"] is None and builder.usage_chunk({"x": 1})["choices"] == []
    logprobs = completion_logprobs([1, 2], [-0.5, -1.0], {1: "ab", 2: "c"}.get, 3)
    assert logprobs["tokens"] == ["ab", "c"] and logprobs["text_offset"] == [3, 5]
    with pytest.raises(ValueError, match="kind must be chat or completion"):
        ResponseBuilder("edit", "x", 0, "m")


def test_server_config_validates(tmp_path):
    limits = Limits(max_batch_size=1, max_num_tokens=8, max_input_len=8, max_seq_len=16)
    good = dict(triton_grpc_url="127.0.0.1:1", model_name="m", tokenizer_dir=tmp_path,
                limits=limits)
    OpenAIServerConfig(**good)
    for bad, message in [({"port": 70000}, "openai port must be an integer in 0..65535"),
                         ({"triton_model": "preprocessing"}, "triton_model must be one of"),
                         ({"max_concurrent_requests": 0}, "max_concurrent_requests must be"),
                         ({"tokenizer_dir": tmp_path / "nope"}, "no such directory")]:
        with pytest.raises(ValueError, match=message):
            OpenAIServerConfig(**{**good, **bad})


def test_bench_protocols_one_per_server():
    from builder.cli.bench import _BadInput, _targets

    targets = _targets("a:1", None, "openai,grpc", ("a:1", "b:2"), None, None, None)
    assert [(t.protocol, t.model) for t in targets] == [("openai", None), ("grpc", "ensemble")]
    assert _targets("a:1", None, "http", None, None, None, None)[0].model == "ensemble"
    for bad in ("openai,grpc", "smtp"):
        with pytest.raises(_BadInput, match="--protocol must be one of grpc, http, openai"):
            _targets("a:1", None, bad, None, None, None, None)


def test_a_stream_has_a_chunk_for_every_token_even_before_its_character_is_whole():
    """The four bytes of an emoji come as four tokens: four chunks, the first three with empty
    text (as vLLM streams them), so a client counts every token and times each; a response with
    neither a token nor an end (the ensemble path sends no ids) is no chunk."""
    import asyncio
    import json

    from builder.serving.openai.service import Generation
    from builder.serving.openai.streaming import sse_events
    from builder.serving.openai.triton import Chunk

    class Service:
        def logprobs(self, *args):
            return None

    request = CompletionRequest(model="m", prompt="p", stream=True,
                                stream_options={"include_usage": True})
    generation = Generation(request, {}, "prompt", False, ResponseBuilder("completion", "c", 0, "m"))
    chunks = [Chunk("", "", 3, 1, token_ids=[7]), Chunk("", "", 3, 2, token_ids=[8]),
              Chunk("", "", 3, 2), Chunk("", "", 3, 3, token_ids=[9]),
              Chunk("\U0001f642", "", 3, 4, token_ids=[10]), Chunk("!", "length", 3, 5, token_ids=[11])]

    async def rest():
        for chunk in chunks[1:]:
            yield 0, chunk

    async def gather():
        return [event async for event in sse_events(Service(), generation, (0, chunks[0]), rest())]

    events = asyncio.run(gather())
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [b["choices"][0]["text"] for b in bodies if b["choices"]]
    assert texts == ["", "", "", "\U0001f642", "!"]
    assert [b["choices"][0]["finish_reason"] for b in bodies if b["choices"]][-1] == "length"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 5

"""Structured output end to end: `forge serve --openai-port` (a real tritonserver serving the demo
model) driven by the official `openai` client, and NVIDIA's guided decoding inputs through the
ensemble and the BLS over gRPC. Every output is checked against its guide (`jsonschema`,
`re.fullmatch`); every bad guide is a 400 / a Triton error naming the field, and the server keeps
serving."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from builder.bench.guided_schemas import SCHEMAS
from builder.bench.guided_schemas import closed as _closed
from builder.client import decode_text, stream_grpc, text_inputs
from test_openai_e2e import executor_stats, serve_openai
from triton_backend.engine.guided import MAX_GUIDE_CHARS

pytestmark = pytest.mark.slow
NAME = "smollm2-guided"
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
EBNF = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30}'
MESSAGES = [{"role": "user", "content": "Describe a person, a place or a thing as JSON."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_openai(tmp_path_factory.mktemp("guided"), {
        "name": NAME, "limits": {"max_batch_size": 16, "max_num_tokens": 1024,
                                 "max_input_len": 256, "max_seq_len": 1024},
        "kv_cache": {"num_blocks": 512}})


def _chat(client, stream: bool, **fields) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    fields.setdefault("max_tokens", 256)
    fields.setdefault("messages", MESSAGES)
    if not stream:
        reply = client.chat.completions.create(model=NAME, **fields)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model=NAME, stream=True, **fields))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def test_json_schema_outputs_validate_greedy_and_sampled_streamed_and_not(served):
    client = served.client()
    jobs = [(schema, stream, sampled) for schema in SCHEMAS for stream in (False, True)
            for sampled in (False, True)]

    def run(job):
        schema, stream, sampled = job
        sampling = {"temperature": 0.8, "seed": 7} if sampled else {}
        return _chat(client, stream, response_format=_schema_format(schema), **sampling)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for (schema, stream, sampled), (text, finish) in zip(jobs, results):
        assert finish == "stop", (schema, stream, sampled, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_and_grammar_fields(served):
    client = served.client()
    # Any object: the prompt asks for a small one (an open object may go on as long as a model
    # keeps adding keys).
    text, finish = _chat(client, False, response_format={"type": "json_object"}, messages=[
        {"role": "user", "content": 'What is the capital of France? Answer as JSON: {"city": ...}'}])
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    text, _ = _chat(client, True, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert text in ("red", "green", "blue")
    text, _ = _chat(client, False, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, text), text
    text, _ = _chat(client, False, extra_body={"guided_grammar": EBNF}, temperature=0.7, seed=3)
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}", text), text
    reply = client.completions.create(model=NAME, prompt="Today's date is", max_tokens=32,
                                      extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, reply.choices[0].text), reply.choices[0].text


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_regex_and_ebnf_through_nvidias_inputs(served, model):
    for guide_type, guide, pattern in (("regex", REGEX, REGEX),
                                       ("ebnf_grammar", EBNF, r"(yes|no) because [a-z ]{1,30}")):
        for stream in (False, True):
            chunks = stream_grpc(served.grpc_url, model, text_inputs(
                text_input="Is the sky blue? Answer:", max_tokens=64, stream=stream,
                guided_decoding_guide_type=guide_type, guided_decoding_guide=guide))
            text = "".join(decode_text(chunk) for chunk in chunks)
            assert re.fullmatch(pattern, text), (model, guide_type, text)


def test_a_mixed_concurrent_batch_gives_each_its_own_valid_output(served):
    client = served.client()
    schemas = SCHEMAS[:4]
    jobs = [schemas[i % 4] if i % 4 != 3 else None for i in range(16)]

    def run(schema):
        if schema is None:  # a question whose free answer is a sentence, never JSON
            return _chat(client, True, max_tokens=48, messages=[
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}])
        return _chat(client, bool(jobs.index(schema) % 2), response_format=_schema_format(schema))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    unconstrained = []
    for schema, (text, finish) in zip(jobs, results):
        if schema is None:
            unconstrained.append(text)
            continue
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    # The unconstrained answers are free text, not masked into JSON by their neighbours (whose
    # schemas are all objects: a leaked mask would open one with "{").
    assert all(text and "{" not in text for text in unconstrained), unconstrained


def test_a_second_use_of_a_schema_hits_the_grammar_cache(served):
    # Closed: the one document it allows ends within a few tokens on every CPU (open, the greedy
    # reply on an AVX2 machine added a "description" string that ran to max_tokens).
    schema = _closed({"type": "object", "properties": {"cached": {"type": "boolean"}},
                      "required": ["cached"]})
    client = served.client()
    before = executor_stats(served)
    for _ in range(2):
        text, _ = _chat(client, False, response_format=_schema_format(schema))
        jsonschema.validate(json.loads(text), schema)
    deadline = time.monotonic() + 10
    while True:
        after = executor_stats(served)
        if after["guided_requests"] >= before["guided_requests"] + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["guided_compiles"] == before["guided_compiles"] + 1
    assert after["guided_cache_hits"] == before["guided_cache_hits"] + 1
    assert after["guided_cache_entries"] >= 1 and after["guided_compile_seconds"] > 0


BAD = [
    ({"response_format": _schema_format({"type": "no-such-type"})}, "response_format",
     "response_format: invalid json_schema: Invalid type: no-such-type"),
    ({"extra_body": {"guided_regex": "([0-9]"}}, "guided_regex",
     "guided_regex: invalid regex"),
    ({"extra_body": {"guided_grammar": "root ::= missing_rule"}}, "guided_grammar",
     "guided_grammar: invalid ebnf_grammar"),
    ({"extra_body": {"guided_grammar": 'root ::= "' + "a" * MAX_GUIDE_CHARS + '"'}},
     "guided_grammar", f"guided_grammar has {MAX_GUIDE_CHARS + 11} characters, over the limit "
                       f"of {MAX_GUIDE_CHARS}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema is required"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_guides_are_400s_naming_the_field_and_the_server_keeps_serving(served, stream):
    client = served.client()
    for fields, param, message in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, stream, **fields)
        error = info.value.body
        assert (error["param"], info.value.status_code) == (param, 400)
        assert error["message"].startswith(message), error["message"]
    text, finish = _chat(client, stream, response_format=_schema_format(SCHEMAS[6]))
    assert finish == "stop" and isinstance(json.loads(text)["ok"], bool)


def test_a_bad_guide_through_the_ensemble_is_a_triton_error_naming_the_input(served):
    with pytest.raises(RuntimeError, match="guided_decoding_guide: invalid regex"):
        list(stream_grpc(served.grpc_url, "ensemble", text_inputs(
            text_input="x", max_tokens=8, stream=True, guided_decoding_guide_type="regex",
            guided_decoding_guide="(")))
    with pytest.raises(RuntimeError,
                       match="guided_decoding_guide_type must be one of json, json_schema, regex, "
                             "ebnf_grammar, got 'yaml'"):
        list(stream_grpc(served.grpc_url, "ensemble", text_inputs(
            text_input="x", max_tokens=8, stream=True, guided_decoding_guide_type="yaml",
            guided_decoding_guide="a: 1")))
    text = "".join(decode_text(c) for c in stream_grpc(served.grpc_url, "ensemble", text_inputs(
        text_input="Year:", max_tokens=16, stream=True, guided_decoding_guide_type="regex",
        guided_decoding_guide="[0-9]{4}")))
    assert re.fullmatch("[0-9]{4}", text)


# -- top_logprobs (the engine's alternatives; their values are checked against transformers in
# tests/test_top_logprobs.py) -------------------------------------------------------------------
def test_top_logprobs_on_chat_and_completions(served):
    client = served.client()
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                           logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        alternatives = entry.top_logprobs
        assert len(alternatives) == 5
        values = [a.logprob for a in alternatives]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        # greedy on raw logits: the chosen token is the likeliest (a tie may order it second)
        assert abs(entry.logprob - values[0]) < 1e-6
        assert (entry.token, entry.logprob) in [(a.token, a.logprob) for a in alternatives]
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    completion = client.completions.create(model=NAME, prompt="The capital of France is",
                                           max_tokens=6, logprobs=3)
    top = completion.choices[0].logprobs.top_logprobs
    assert len(top) == len(completion.choices[0].logprobs.tokens)
    assert all(1 <= len(t) <= 3 for t in top)


@pytest.mark.parametrize("fields, param, message", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs: Input should be less than or equal to 20, got 21"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs: needs logprobs true"),
])
def test_bad_top_logprobs_are_400s(served, fields, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4,
                                                **fields)
    assert info.value.body["param"] == param
    assert info.value.body["message"].startswith(message)
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=NAME, prompt="x", max_tokens=4, logprobs=21)
    assert info.value.body["param"] == "logprobs"


# -- tool calling and n choices (the official client) ----------------------------------------
OBJECT_SCHEMAS = [s for s in SCHEMAS if s.get("type") == "object"]
CLOCK = {"type": "function", "function": {"name": "read_clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _tool(i: int) -> dict:
    return {"type": "function", "function": {
        "name": f"record_{i}", "description": "Record the answer",
        "parameters": OBJECT_SCHEMAS[i % len(OBJECT_SCHEMAS)]}}


def _calls(client, stream: bool, **fields) -> tuple[list, str]:
    """(tool calls as (name, arguments text), finish reason) of one chat, streamed or not."""
    fields.setdefault("max_tokens", 256)
    fields.setdefault("messages", MESSAGES)
    if not stream:
        choice = client.chat.completions.create(model=NAME, **fields).choices[0]
        calls = choice.message.tool_calls or []
        assert choice.message.content is None
        return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=NAME, stream=True, **fields):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, ["", ""])
            call[0] += delta.function.name or ""
            call[1] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_required_and_named_tool_calls_validate_twenty_of_twenty(served):
    client = served.client()

    def run(i: int):
        tools = [_tool(i), CLOCK]
        choice = ("required" if i % 2 else
                  {"type": "function", "function": {"name": f"record_{i}"}})
        return _calls(client, i % 3 == 0, tools=tools, tool_choice=choice,
                      parallel_tool_calls=False,
                      **({"temperature": 0.8, "seed": i} if i % 4 == 1 else {}))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(20)))
    for i, (calls, finish) in enumerate(results):
        assert finish == "tool_calls" and len(calls) == 1, (i, calls, finish)
        name, arguments = calls[0]
        schema = {f"record_{i}": OBJECT_SCHEMAS[i % len(OBJECT_SCHEMAS)],
                  "read_clock": CLOCK["function"]["parameters"]}[name]
        assert name == f"record_{i}" or i % 2, (i, name)  # a named function is that one
        jsonschema.validate(json.loads(arguments), schema)


def test_a_follow_up_with_the_tool_result_is_answered(served):
    client = served.client()
    first = client.chat.completions.create(
        model=NAME, max_tokens=64, tools=[CLOCK], tool_choice="required",
        messages=[{"role": "user", "content": "What time is it in Paris?"}])
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    follow_up = [{"role": "user", "content": "What time is it in Paris?"},
                 message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "14:05"}]
    answer = client.chat.completions.create(model=NAME, max_tokens=32, messages=follow_up,
                                            tools=[CLOCK], tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_auto_answers_with_text_or_with_calls_of_the_tools(served, stream):
    """tool_choice auto (the default with tools): the free reply is either text or calls of the
    listed tools whose arguments parse, in OpenAI's shapes, streamed as not."""
    client = served.client()
    for question in ("What time is it in UTC? Use the clock.", "Say hello to me."):
        fields = dict(model=NAME, max_tokens=64, tools=[CLOCK],
                      messages=[{"role": "user", "content": question}])
        if stream:
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(stream=True, **fields):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    calls[call.index] = (call.function.name, call.function.arguments)
                finish = chunk.choices[0].finish_reason or finish
            calls = list(calls.values())
        else:
            choice = client.chat.completions.create(**fields).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            calls = [(c.function.name, c.function.arguments)
                     for c in choice.message.tool_calls or []]
        if calls:
            assert finish == "tool_calls", (question, content, calls)
            for name, arguments in calls:
                assert name == "read_clock" and isinstance(json.loads(arguments), dict)
        else:
            assert finish in ("stop", "length") and content, (question, finish)


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": "low"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters",
     "tools[0].function.parameters: invalid JSON schema"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice names function 'nope'"),
    ({"n": 0}, "n", "n must be in [1, 16], got 0"),
    ({"n": 17}, "n", "n must be in [1, 16], got 17"),
])
def test_bad_tools_and_n_are_400s_and_the_server_keeps_serving(served, fields, param, message):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, max_tokens=8, messages=MESSAGES, **fields)
    assert info.value.body["param"] == param
    assert info.value.body["message"].startswith(message), info.value.body
    text, _ = _chat(client, False, max_tokens=4)
    assert text


def test_n_choices_equal_single_requests_with_the_derived_seeds(served):
    """Four sampled choices with seed s are the four single requests with seeds s..s+3, streamed
    or not; the prompt's blocks are computed once (three choices hit the prefix cache)."""
    client = served.client()
    messages = [{"role": "user", "content": "Write one sentence about the sea. " * 6}]
    sampling = {"temperature": 0.8, "top_k": 20, "min_tokens": 16}

    def single(seed: int) -> str:
        reply = client.chat.completions.create(model=NAME, max_tokens=16, messages=messages,
                                               seed=seed, extra_body=sampling)
        return reply.choices[0].message.content

    single(1)  # the prompt's blocks are in the prefix cache for every request below
    before = executor_stats(served)
    reply = client.chat.completions.create(model=NAME, max_tokens=16, messages=messages, n=4,
                                           seed=40, extra_body=sampling)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 64
    time.sleep(0.2)
    after = executor_stats(served)
    prompt_tokens = reply.usage.prompt_tokens
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= \
        4 * 16 * ((prompt_tokens - 1) // 16)
    texts = [c.message.content for c in reply.choices]
    assert texts == [single(40 + i) for i in range(4)]
    assert len(set(texts)) > 1  # sampled with different seeds: not one answer four times
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=NAME, max_tokens=16, messages=messages,
                                                n=4, seed=40, stream=True, extra_body=sampling):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts

"""Tool calling and `n` choices in the OpenAI endpoint, without a server: the tools' guide, the
parsing of calls, tool turns in the prompt, the choices' seeds and the fan-out to Triton."""
import asyncio
import json

import jsonschema
import pytest

from builder.serving.openai.chat import ChatRenderer, conversation
from builder.serving.openai.errors import OpenAIError
from builder.serving.openai.protocol import ChatCompletionRequest, ChatMessage, check_chat
from builder.serving.openai.service import Generation, OpenAIService
from builder.serving.openai.tools import parse_auto, tool_calls, tool_plan
from builder.serving.openai.triton import Chunk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {}


def test_required_is_an_array_of_calls_of_any_tool():
    plan = tool_plan([WEATHER, TIME], "required", None)
    schema = json.loads(plan.guide.guide)
    assert (plan.guide.guide_type, plan.guide.field, plan.named) == ("json_schema", "tools", None)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert json.loads(tool_plan([WEATHER], "required", False).guide.guide)["maxItems"] == 1


def test_a_named_function_is_one_call_of_it():
    plan = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                     None)
    schema = json.loads(plan.guide.guide)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    [call] = tool_calls(plan, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_calls_are_parsed_and_an_unfinished_one_is_not():
    plan = tool_plan([WEATHER, TIME], "required", None)
    calls = tool_calls(plan, '[{"name": "get_time", "arguments": {}}, '
                             '{"name": "get_weather", "arguments": {"city": "Ås"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Ås"}
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls(plan, '[{"name": "get_time", "argu') is None


def test_auto_is_the_default_with_tools_and_answers_freely():
    for choice in (None, "auto"):
        plan = tool_plan([WEATHER, TIME], choice, None)
        assert plan.auto and plan.guide is None and plan.tools == [WEATHER, TIME]


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (' [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "parameters": '
     '{"city": "Rome"}}]', None, [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Ås\\"}"}'
     '\n</tool_call>', "Let me look.", [("get_weather", {"city": "Ås"})]),
    ("It is sunny in Oslo.", "It is sunny in Oslo.", None),
    ('{"name": "launch_rocket", "arguments": {}}', '{"name": "launch_rocket", "arguments": {}}',
     None),  # not one of the tools
    ('{"name": "get_weather", "arguments": {"city": "Os', '{"name": "get_weather", '
     '"arguments": {"city": "Os', None),  # cut short
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", None),
])
def test_an_auto_reply_is_calls_only_in_a_format_we_know(text, content, calls):
    got_content, got_calls = parse_auto(tool_plan([WEATHER, TIME], "auto", None), text)
    assert got_content == content
    if calls is None:
        assert got_calls is None
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got_calls] == calls


def test_no_tools_or_none_is_plain_generation():
    assert tool_plan(None, None, None) is None
    assert tool_plan([WEATHER], "none", None) is None


@pytest.mark.parametrize("tools, choice, param, message", [
    (None, "required", "tool_choice", "tool_choice 'required' needs tools"),
    ([WEATHER], "sometimes", "tool_choice", "tool_choice must be one of none, auto, required"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "tool_choice names function 'nope', which is not among the tools (get_weather)"),
    ([WEATHER], {"type": "function"}, "tool_choice", "tool_choice must be one of"),
    ([{"type": "retrieval"}], "required", "tools[0]",
     'tools[0].type must be "function", got \'retrieval\''),
    ([{"type": "function", "function": {"name": "a b"}}], "required", "tools[0].function.name",
     "tools[0].function.name must be 1-64 letters, digits, _ or -, got 'a b'"),
    ([WEATHER, WEATHER], "required", "tools[1].function.name",
     "tools[1].function.name: 'get_weather' is listed twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}],
     "required", "tools[0].function.parameters",
     "tools[0].function.parameters: invalid JSON schema: Invalid type: banana"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "none",
     "tools[0].function.parameters",
     "tools[0].function.parameters must be a JSON schema object, got list"),
])
def test_bad_tools_and_choices_are_400s_naming_the_field(tools, choice, param, message):
    with pytest.raises(OpenAIError) as info:
        tool_plan(tools, choice, None)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(message), info.value.message


def test_tools_and_another_constraint_are_refused():
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "tool_choice": "required", "response_format": {"type": "json_object"}})
    with pytest.raises(OpenAIError) as info:
        check_chat(request)
    assert info.value.param == "tool_choice"
    assert "drop response_format" in info.value.message


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
FOLLOW_UP = [ChatMessage(role="system", content="Be brief."),
             ChatMessage(role="user", content="Weather in Oslo?"),
             ChatMessage(role="assistant", content=None, tool_calls=[CALL]),
             ChatMessage(role="tool", content="12 C", tool_call_id="call_1")]


def test_tool_turns_for_a_template_that_reads_them():
    turns = conversation(FOLLOW_UP, template_tools=True)
    assert turns[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert turns[3] == {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}


def test_tool_turns_as_text_for_a_template_that_does_not(chat_tokenizer):
    turns = conversation(FOLLOW_UP, template_tools=False)
    # the calls as the model writes them under the tools' guide
    assert turns[2]["content"] == '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert turns[3] == {"role": "user", "content": "Result of tool call call_1: 12 C"}
    renderer = ChatRenderer(chat_tokenizer, True)
    assert not renderer.template_tools
    text = renderer.render(FOLLOW_UP, [WEATHER])
    # One system turn: the functions, then the client's own system text.
    assert text.count("[system]") == 1 and '"name": "get_weather"' in text
    assert text.index("Functions:") < text.index("Be brief.") < text.index("[user]")


def _generation(n, seed=None):
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n, "seed": seed})
    from builder.serving.openai.responses import ResponseBuilder

    return Generation(request, {"text_input": "hi", "seed": seed}, "messages", False,
                      ResponseBuilder("chat", "chatcmpl-x", 0, "m"))


def test_choice_i_takes_seed_plus_i():
    generation = _generation(4, seed=2 ** 64 - 2)
    assert [generation.choice_values(i)["seed"] for i in range(4)] == \
        [2 ** 64 - 2, 2 ** 64 - 1, 0, 1]
    assert _generation(3).choice_values(2)["seed"] is None


class FakeBackend:
    """Each choice streams 3 chunks; records when each request started."""

    def __init__(self, fail: str | None = None):
        self.started, self.fail, self.closed = [], fail, []
        self.first_chunks = 0  # chunks choice 0 has given so far

    async def generate(self, values, request_id, prompt_field, log_probs):
        self.started.append((request_id, values["seed"], self.first_chunks))
        try:
            for i in range(3):
                await asyncio.sleep(0.001)
                if request_id == self.fail and i == 1:
                    raise OpenAIError(400, f"{request_id} failed", "prompt")
                self.first_chunks += request_id.endswith("-0")
                yield Chunk(f"{request_id}:{i} ", "stop" if i == 2 else "", 5, i + 1,
                            token_ids=[i])
        finally:
            self.closed.append(request_id)


def _service(backend, limit=64):
    service = OpenAIService.__new__(OpenAIService)
    service.backend, service.in_flight = backend, 0
    service.config = type("C", (), {"max_concurrent_requests": limit})()
    return service


def test_n_choices_start_after_the_first_token_and_all_arrive():
    backend = FakeBackend()
    service = _service(backend)

    async def run():
        out = [item async for item in service.chunks(_generation(3, seed=7))]
        return out

    items = asyncio.run(run())
    assert sorted({index for index, _ in items}) == [0, 1, 2]
    assert [request_id for request_id, _, _ in backend.started] == \
        ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [seed for _, seed, _ in backend.started] == [7, 8, 9]
    # the others started once choice 0 had its first token (its prompt is in the prefix cache)
    assert [chunks for _, _, chunks in backend.started] == [0, 1, 1] and items[0][0] == 0
    for index in range(3):
        texts = [chunk.text for i, chunk in items if i == index]
        assert texts == [f"chatcmpl-x-{index}:{k} " for k in range(3)]
    assert service.in_flight == 0


def test_an_error_in_one_choice_ends_them_all_and_admission_counts_n():
    backend = FakeBackend(fail="chatcmpl-x-1")
    service = _service(backend)

    async def run():
        return [item async for item in service.chunks(_generation(3))]

    with pytest.raises(OpenAIError, match="chatcmpl-x-1 failed"):
        asyncio.run(run())
    assert sorted(backend.closed) == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert service.in_flight == 0
    busy = _service(FakeBackend(), limit=2)

    async def refused():
        return [item async for item in busy.chunks(_generation(3))]

    with pytest.raises(OpenAIError, match="the server is busy"):
        asyncio.run(refused())


class ToolTemplateTokenizer:
    """A tokenizer whose chat template reads `tools` (as Qwen's and Llama 3's do)."""

    chat_template = "{% for tool in tools %}...{% endfor %}"
    bos_token = None

    def apply_chat_template(self, turns, add_generation_prompt, tokenize, **kwargs):
        self.seen = (turns, kwargs)
        return "rendered"


def test_a_template_that_reads_tools_gets_them_and_the_tool_turns():
    tokenizer = ToolTemplateTokenizer()
    renderer = ChatRenderer(tokenizer, False)
    assert renderer.template_tools
    assert renderer.render(FOLLOW_UP, [WEATHER]) == "rendered"
    turns, kwargs = tokenizer.seen
    assert kwargs == {"tools": [WEATHER]}
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
    assert turns[0]["content"] == "Be brief."  # no system turn of ours: the template lists them
    assert turns[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}

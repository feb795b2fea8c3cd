"""Tool calling on `/v1/chat/completions`. For `tool_choice: "required"` and a named function, as
vLLM serves them, the tools' parameter schemas become one JSON schema guide, so guided decoding
writes a call that validates; for `"auto"` the model answers freely and a reply that is a call
is recognised (`parse_auto`). The tools are shown to the model through its chat template's
`tools` argument (or, for a template that ignores them, a system turn listing them); the answer
is parsed back into OpenAI's `tool_calls`.

| `tool_choice` | the model writes | the response |
| --- | --- | --- |
| `"none"`, or no tools | text (tools not shown) | `content` |
| `"required"` | `[{"name": ..., "arguments": {...}}, ...]`, one call or more (one with `parallel_tool_calls: false`) | `tool_calls`, `finish_reason: "tool_calls"` |
| `{"type": "function", "function": {"name": N}}` | `{"name": N, "arguments": {...}}` | one call of N |
| `"auto"` (the default with tools, as OpenAI's) | text or calls, unconstrained | `tool_calls` when the reply is calls, else `content` |

`auto` recognises the two call formats models are taught: Hermes/Qwen's `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (text around them is the content), and a reply that is
only the JSON of one call or a list of calls (what our system turn asks for, and Llama 3.x's
JSON form; `parameters` is taken for `arguments`). A name that is not among the tools, or JSON
that does not parse, leaves the reply as text. A model family with another format (Mistral's
`[TOOL_CALLS]`, Llama's `<|python_tag|>`) gets its reply as text.

A call that did not finish (the answer hit `max_tokens`) comes back as text with
`finish_reason: "length"`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from builder.serving.openai.errors import bad_request
from builder.serving.openai.structured import Guide

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the guide, the tools the template shows, how to parse."""

    guide: Guide | None  # None: `auto`, the model answers freely
    tools: list[dict]  # OpenAI's tool objects, validated, for the chat template
    named: str | None  # the one function `tool_choice` names, else None ("required", "auto")

    @property
    def auto(self) -> bool:
        return self.guide is None


def tool_plan(tools: list[Any] | None, tool_choice: Any,
              parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's tool plan, None for plain generation; a 400 naming the field when the tools
    or the choice are malformed."""
    choice = "auto" if tool_choice is None and tools else (tool_choice or "none")
    if isinstance(choice, str) and choice not in CHOICES:
        raise bad_request("tool_choice", f"tool_choice must be one of none, auto, required or "
                                         f"{{\"type\": \"function\", \"function\": {{\"name\": "
                                         f"...}}}}, got {choice!r}")
    if choice == "none":
        if tools is not None:
            _functions(tools)  # still checked: a malformed request is refused either way
        return None
    if not tools:
        raise bad_request("tool_choice", f"tool_choice {_describe(choice)} needs tools")
    functions = _functions(tools)
    if choice == "auto":
        return ToolPlan(None, tools, None)
    if choice == "required":
        calls = [_call_schema(name, parameters) for name, parameters in functions.items()]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(Guide("json_schema", json.dumps(schema), "tools"), tools, None)
    name = _named(choice)
    if name not in functions:
        raise bad_request("tool_choice", f"tool_choice names function {name!r}, which is not "
                                         f"among the tools ({', '.join(functions)})")
    return ToolPlan(Guide("json_schema", json.dumps(_call_schema(name, functions[name])),
                          "tools"), tools, name)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "naming a function"


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise bad_request("tool_choice", "tool_choice must be one of none, auto, required or "
                                         "{\"type\": \"function\", \"function\": {\"name\": ...}}"
                                         f", got {choice!r}")
    return function["name"]


def _functions(tools: list[Any]) -> dict[str, dict]:
    """{name: parameters schema} of the tools; a 400 naming the first bad one."""
    import llguidance

    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        field = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(field, f"{field}.type must be \"function\", got "
                                     f"{tool.get('type') if isinstance(tool, dict) else tool!r}")
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"{field}.function.name", f"{field}.function.name must be 1-64 "
                                                        f"letters, digits, _ or -, got {name!r}")
        if name in functions:
            raise bad_request(f"{field}.function.name", f"{field}.function.name: {name!r} is "
                                                        f"listed twice")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        where = f"{field}.function.parameters"
        if not isinstance(parameters, dict):
            raise bad_request(where, f"{where} must be a JSON schema object, got "
                                     f"{type(parameters).__name__}")
        problem = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(parameters), None)
        if problem:
            raise bad_request(where, f"{where}: invalid JSON schema: {problem}")
        functions[name] = parameters
    return functions


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_calls(plan: ToolPlan, text: str) -> list[dict] | None:
    """OpenAI's `tool_calls` of a finished guided answer; None when the text is not a whole call
    (it stopped at max_tokens)."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [parsed] if plan.named is not None else parsed
    return [_openai_call(call["name"], call["arguments"]) for call in calls]


TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_auto(plan: ToolPlan, text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool calls) of a free `auto` reply: calls when it holds them in a format we
    know (see the module's docstring), else (text, None)."""
    names = {tool["function"]["name"] for tool in plan.tools}
    blocks = TAGGED_CALL.findall(text)
    if blocks:
        calls = [_loaded(block) for block in blocks]
        rest = TAGGED_CALL.sub("", text).strip()
    else:
        parsed = _loaded(text.strip())
        calls = parsed if isinstance(parsed, list) and parsed else [parsed]
        rest = ""
    calls = [_normalised(call, names) for call in calls]
    if any(call is None for call in calls):
        return text, None
    return rest or None, [_openai_call(name, arguments) for name, arguments in calls]


def _loaded(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _normalised(call, names: set[str]) -> tuple[str, dict] | None:
    """(name, arguments) of one parsed call, None if it is not a call of a listed tool."""
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loaded(arguments)
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _openai_call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def system_turn(tools: list[dict]) -> dict[str, str]:
    """For a chat template that does not take `tools`: the functions, as a system turn."""
    listed = json.dumps([tool["function"] for tool in tools], ensure_ascii=False)
    return {"role": "system", "content": "You can call these functions. To call one, answer "
                                         "with only the call as JSON: {\"name\": ..., "
                                         "\"arguments\": {...}}.\n"
                                         f"Functions: {listed}"}

"""Tool calling on `/v1/chat/completions`, as vLLM serves `tool_choice: "required"` and a named
function: the tools' parameter schemas become one JSON schema guide, so guided decoding writes a
call that validates; the tools are shown to the model through its chat template's `tools`
argument (or, for a template that ignores them, a system turn listing them); the answer is
parsed back into OpenAI's `tool_calls`.

| `tool_choice` | the model writes | the response |
| --- | --- | --- |
| `"none"`, or no tools | text (tools not shown) | `content` |
| `"required"` | `[{"name": ..., "arguments": {...}}, ...]`, one call or more (one with `parallel_tool_calls: false`) | `tool_calls`, `finish_reason: "tool_calls"` |
| `{"type": "function", "function": {"name": N}}` | `{"name": N, "arguments": {...}}` | one call of N |
| `"auto"` (OpenAI's default with tools) | refused: telling a call from text needs a parser for the model's own tool-call format, which we do not have (vLLM refuses it too without `--enable-auto-tool-choice`) | 400 naming `tool_choice` |

A call that did not finish (the answer hit `max_tokens`) comes back as text with
`finish_reason: "length"`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from builder.openai.errors import bad_request
from builder.openai.structured import Guide

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the guide, the tools the template shows, how to parse."""

    guide: Guide
    tools: list[dict]  # OpenAI's tool objects, validated, for the chat template
    named: str | None  # the one function `tool_choice` names, else None ("required")


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
        raise bad_request("tool_choice", "tool_choice: auto is not supported (this server has no "
                                         "parser for the model's own tool-call format); send "
                                         "tool_choice \"required\" or name a function")
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
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"],
                          "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in calls]


def system_turn(tools: list[dict]) -> dict[str, str]:
    """For a chat template that does not take `tools`: the functions, as a system turn."""
    listed = json.dumps([tool["function"] for tool in tools], ensure_ascii=False)
    return {"role": "system", "content": "You can call these functions. Answer with the call as "
                                         f"JSON: {{\"name\": ..., \"arguments\": {{...}}}}.\n"
                                         f"Functions: {listed}"}

"""Chat messages -> the prompt text, rendered with the engine's own chat template.

The template comes from the engine's tokenizer (`tokenizer_config.json` / `chat_template.jinja`)
and is rendered with `add_generation_prompt`, so the text ends where the assistant's answer
begins. A model without a template gets a 400: guessing a format would silently degrade answers.

Tool calling (`tools.py`): a template that reads `tools` gets them, and the conversation's tool
turns as Hugging Face's templates expect them (an assistant turn's `tool_calls`, `tool` turns
with their `tool_call_id`). A template that does not (SmolLM2's) gets the functions as a system
turn, an assistant's calls as their JSON text and each tool result as a user turn naming its
call, so every template can render a conversation with tool turns.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from builder.serving.openai.errors import bad_request
from builder.serving.openai.protocol import ChatMessage
from builder.serving.openai.tools import system_turn

# `developer` is the newer name OpenAI gives the system turn; templates only know `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _content(message: ChatMessage, index: int) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content-part form)."""
    field = f"messages[{index}].content"
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise bad_request(field, f"{field}: required for role {message.role!r}")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{field}[{part_index}]",
                              f"{field}[{part_index}]: only text parts are supported, got type "
                              f"{part.get('type')!r}")
        texts.append(part["text"])
    return "".join(texts)


def conversation(messages: Sequence[ChatMessage], template_tools: bool = False) -> list[dict]:
    """Validated `{"role", "content"}` turns as chat templates expect them; tool turns in the
    form the template reads (`template_tools`) or as plain text."""
    if not messages:
        raise bad_request("messages", "messages: must hold at least one message")
    turns = []
    for index, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise bad_request(f"messages[{index}].role",
                              f"messages[{index}].role: must be one of system, user, assistant, "
                              f"tool (or developer), got {message.role!r}")
        turn: dict[str, Any] = {"role": role, "content": _content(message, index)}
        if role == "tool":
            turn = _tool_result(turn["content"], message, index, template_tools)
        calls = (message.model_extra or {}).get("tool_calls")
        if role == "assistant" and calls:
            calls = _calls(calls, index)
            if template_tools:
                turn["tool_calls"] = calls
            else:
                turn["content"] += json.dumps([c["function"] for c in calls], ensure_ascii=False)
        turns.append(turn)
    return turns


def _tool_result(content: str, message: ChatMessage, index: int, template_tools: bool) -> dict:
    call_id = (message.model_extra or {}).get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"messages[{index}].tool_call_id",
                          f"messages[{index}].tool_call_id: required for role 'tool'")
    if template_tools:
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    return {"role": "user", "content": f"Result of tool call {call_id}: {content}"}


def _calls(calls: Any, index: int) -> list[dict]:
    """An assistant turn's `tool_calls`, with their arguments as objects (as templates read
    them)."""
    field = f"messages[{index}].tool_calls"
    out = []
    for i, call in enumerate(calls if isinstance(calls, list) else [None]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise bad_request(f"{field}[{i}]", f"{field}[{i}]: must be {{\"id\", \"type\": "
                                               f"\"function\", \"function\": {{\"name\", "
                                               f"\"arguments\"}}}} with arguments as a JSON string")
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            raise bad_request(f"{field}[{i}]", f"{field}[{i}].function.arguments is not valid "
                                               f"JSON") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer, add_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.template_tools = isinstance(template, str) and "tools" in template
        # The repository tokenizes text_input with add_special_tokens; a template that writes
        # the BOS token itself would then get a second one, so the rendered one is dropped.
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = bool(add_special_tokens and bos and tokenizer.bos_token_id is not None
                        and tokenizer.encode("a", add_special_tokens=True)[:1]
                        == [tokenizer.bos_token_id])
        self._strip_prefix = bos if adds_bos else None

    def render(self, messages: Sequence[ChatMessage], tools: list[dict] | None = None) -> str:
        """The prompt text; `tools`: the functions the model may call (tool calling)."""
        turns = conversation(messages, self.template_tools)
        if not self.has_template:
            raise bad_request("messages", "messages: this model has no chat template; use "
                                          "/v1/completions with a plain prompt")
        extra = {}
        if tools and self.template_tools:
            extra["tools"] = tools
        elif tools:  # one system turn: the functions, then the client's own system text
            listed = system_turn(tools)
            if turns[0]["role"] == "system":
                listed["content"] += "\n\n" + turns.pop(0)["content"]
            turns = [listed, *turns]
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                      tokenize=False, **extra)
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise bad_request("messages", f"messages: the chat template refused them: "
                                          f"{exc}") from None
        if self._strip_prefix and text.startswith(self._strip_prefix):
            text = text[len(self._strip_prefix):]
        return text

    def count_tokens(self, text: str, add_special_tokens: bool) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

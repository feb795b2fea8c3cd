"""Chat messages -> the prompt text, rendered with the engine's own chat template.

The template comes from the engine's tokenizer (`tokenizer_config.json` / `chat_template.jinja`)
and is rendered with `add_generation_prompt`, so the text ends where the assistant's answer
begins. A model without a template gets a 400: guessing a format would silently degrade answers.
"""
from __future__ import annotations

from typing import Sequence

from builder.openai.errors import bad_request
from builder.openai.protocol import ChatMessage

# `developer` is the newer name OpenAI gives the system turn; templates only know `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


def conversation(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Validated `{"role", "content"}` turns as chat templates expect them."""
    if not messages:
        raise bad_request("messages", "messages: must hold at least one message")
    turns = []
    for index, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise bad_request(f"messages[{index}].role",
                              f"messages[{index}].role: must be one of system, user, assistant "
                              f"(or developer), got {message.role!r}")
        turns.append({"role": role, "content": _content(message, index)})
    return turns


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer, add_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        # The repository tokenizes text_input with add_special_tokens; a template that writes
        # the BOS token itself would then get a second one, so the rendered one is dropped.
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = bool(add_special_tokens and bos and tokenizer.bos_token_id is not None
                        and tokenizer.encode("a", add_special_tokens=True)[:1]
                        == [tokenizer.bos_token_id])
        self._strip_prefix = bos if adds_bos else None

    def render(self, messages: Sequence[ChatMessage]) -> str:
        turns = conversation(messages)
        if not self.has_template:
            raise bad_request("messages", "messages: this model has no chat template; use "
                                          "/v1/completions with a plain prompt")
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise bad_request("messages", f"messages: the chat template refused them: "
                                          f"{exc}") from None
        if self._strip_prefix and text.startswith(self._strip_prefix):
            text = text[len(self._strip_prefix):]
        return text

    def count_tokens(self, text: str, add_special_tokens: bool) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

"""Structured output: OpenAI's `response_format` and vLLM's guided-decoding fields -> NVIDIA's
`guided_decoding_guide_type` / `guided_decoding_guide` inputs.

| request field | guide type | guide |
| --- | --- | --- |
| `response_format: {type: json_object}` | `json_schema` | `{"type": "object"}` |
| `response_format: {type: json_schema, json_schema: {schema}}` | `json_schema` | the schema |
| `guided_json` / `structured_outputs.json` (a schema, object or text) | `json_schema` | the schema |
| `structured_outputs.json_object: true` | `json_schema` | `{"type": "object"}` |
| `guided_regex` / `structured_outputs.regex` | `regex` | the regex |
| `guided_grammar` / `structured_outputs.grammar` | `ebnf_grammar` | the grammar (GBNF or Lark) |
| `guided_choice` / `structured_outputs.choice` | `ebnf_grammar` | `root ::= "a" \\| "b"` |

At most one of them per request. The engine compiles the guide; its errors come back naming
`guided_decoding_guide` and are renamed to the field the client sent (`guide_field`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from builder.serving.openai.errors import bad_request

OBJECT_SCHEMA = '{"type": "object"}'
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Guide:
    guide_type: str
    guide: str
    field: str  # the request field it came from, for error messages


def request_guide(request) -> Guide | None:
    """The one guide a request asks for, or None; a 400 naming the field for a bad one."""
    found = [g for g in (_response_format(request.response_format),
                         *_vllm_fields(request), *_structured_outputs(request)) if g is not None]
    if len(found) > 1:
        names = ", ".join(g.field for g in found)
        raise bad_request(found[1].field, f"{found[1].field}: only one structured output "
                                          f"constraint per request, got {names}")
    return found[0] if found else None


def _response_format(value: dict[str, Any] | None) -> Guide | None:
    if not value:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", OBJECT_SCHEMA, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format", "response_format.json_schema.schema is "
                                                 "required for type json_schema")
        return _schema_guide(spec["schema"], "response_format")
    raise bad_request("response_format", "response_format.type must be one of text, "
                                         f"json_object, json_schema, got {kind!r}")


def _vllm_fields(request) -> list[Guide | None]:
    extra = request.model_extra or {}
    return [
        _schema_guide(extra["guided_json"], "guided_json") if extra.get("guided_json") is not None
        else None,
        _text_guide(extra.get("guided_regex"), "regex", "guided_regex"),
        _text_guide(extra.get("guided_grammar"), "ebnf_grammar", "guided_grammar"),
        _choice_guide(extra.get("guided_choice"), "guided_choice"),
    ]


def _structured_outputs(request) -> list[Guide | None]:
    value = (request.model_extra or {}).get("structured_outputs")
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("structured_outputs", "structured_outputs must be an object with one "
                                                f"of {', '.join(STRUCTURED_KEYS)}")
    unknown = sorted(k for k, v in value.items() if v is not None and k not in STRUCTURED_KEYS
                     and k not in ("disable_fallback", "disable_any_whitespace",
                                   "disable_additional_properties", "whitespace_pattern"))
    if unknown:
        raise bad_request("structured_outputs", f"structured_outputs.{unknown[0]} is not "
                                                f"supported (supported: {', '.join(STRUCTURED_KEYS)})")
    guides = [
        _schema_guide(value["json"], "structured_outputs.json")
        if value.get("json") is not None else None,
        _text_guide(value.get("regex"), "regex", "structured_outputs.regex"),
        _text_guide(value.get("grammar"), "ebnf_grammar", "structured_outputs.grammar"),
        _choice_guide(value.get("choice"), "structured_outputs.choice"),
        Guide("json_schema", OBJECT_SCHEMA, "structured_outputs.json_object")
        if value.get("json_object") else None,
    ]
    return guides


def _schema_guide(schema: Any, field: str) -> Guide:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(field, f"{field}: the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise bad_request(field, f"{field}: the schema must be a JSON object, got "
                                 f"{type(schema).__name__}")
    return Guide("json_schema", json.dumps(schema), field)


def _text_guide(value: Any, guide_type: str, field: str) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise bad_request(field, f"{field} must be a non-empty string")
    return Guide(guide_type, value, field)


def _choice_guide(value: Any, field: str) -> Guide | None:
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or any(not isinstance(c, str) or not c for c in value)):
        raise bad_request(field, f"{field} must be a non-empty list of non-empty strings")
    # GBNF string literals take JSON's escapes for quotes, backslashes and control characters.
    return Guide("ebnf_grammar", "root ::= " + " | ".join(
        json.dumps(c, ensure_ascii=False) for c in value), field)


def rename_guide_error(message: str, guide: Guide | None) -> str:
    """`guided_decoding_guide: ...` from the engine -> `<the client's field>: ...`."""
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        if guide is not None and message.startswith(name):
            return guide.field + message[len(name):]
    return message

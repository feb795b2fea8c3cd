"""Structured output fields of the OpenAI endpoint -> NVIDIA's guided decoding inputs (pure)."""
import json

import pytest

from builder.serving.openai.errors import OpenAIError, from_triton
from builder.serving.openai.mapping import ensemble_values
from builder.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from builder.serving.openai.structured import Guide, rename_guide_error, request_guide

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields, guide_type, guide, field", [
    ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}',
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     "json_schema", json.dumps(SCHEMA), "response_format"),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+", "guided_regex"),
    ({"guided_grammar": 'root ::= "x"'}, "ebnf_grammar", 'root ::= "x"', "guided_grammar"),
    ({"guided_choice": ["yes", 'say "no"']}, "ebnf_grammar", 'root ::= "yes" | "say \\"no\\""',
     "guided_choice"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "b+"}}, "regex", "b+", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "ebnf_grammar", 'root ::= "a" | "b"',
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: /x+/"}}, "ebnf_grammar", "start: /x+/",
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}',
     "structured_outputs.json_object"),
])
def test_each_field_becomes_one_guide(fields, guide_type, guide, field):
    assert request_guide(_chat(**fields)) == Guide(guide_type, guide, field)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})
    values = ensemble_values(completion, "p", 8, False, request_guide(completion))
    assert (values["guided_decoding_guide_type"], values["guided_decoding_guide"]) == \
        (guide_type, guide)


def test_no_constraint_sends_no_guide():
    assert request_guide(_chat(response_format={"type": "text"})) is None
    assert "guided_decoding_guide" not in ensemble_values(_chat(), "p", 8, False)


@pytest.mark.parametrize("fields, param, message", [
    ({"guided_json": "{oops"}, "guided_json", "guided_json: the schema is not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "guided_json: the schema must be a JSON object, got list"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
    ({"guided_choice": []}, "guided_choice",
     "guided_choice must be a non-empty list of non-empty strings"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs",
     "structured_outputs.xml is not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "guided_regex: only one structured output constraint per request"),
])
def test_malformed_constraints_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(OpenAIError) as info:
        request_guide(_chat(**fields))
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(message)


def test_engine_errors_are_renamed_to_the_clients_field():
    error = from_triton("guided_decoding_guide: invalid regex: unclosed group", "messages")
    assert (error.status, error.param) == (400, "guided_decoding_guide")
    guide = Guide("regex", "(", "guided_regex")
    assert rename_guide_error(error.message, guide) == "guided_regex: invalid regex: unclosed group"
    assert rename_guide_error("max_tokens must be >= 1", guide) == "max_tokens must be >= 1"

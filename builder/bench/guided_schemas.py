"""The 20 JSON schemas guided decoding is measured and tested with (`forge bench guided`, the
end-to-end tests): objects, arrays, enums, nested documents, each closed and bounded."""
from __future__ import annotations

import json

# Bounded, so every document ends within max_tokens: strings have a maxLength, numbers a
# multipleOf (JSON Schema puts no bound on a number's digits, and a model may write them forever;
# a power of two, which jsonschema's float division checks exactly: 40.12 / 0.01 is not whole).
S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "unsure"]}},
     "required": ["answer"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": S, "minItems": 1,
                                                 "maxItems": 3}}, "required": ["colors"]},
    {"type": "object", "properties": {"score": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                         "email": S}, "required": ["id", "email"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                           "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": S},
     "required": ["level", "label"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900,
                                                           "maximum": 2100},
                                      "genres": {"type": "array", "items": {
                                          "enum": ["drama", "comedy", "sci-fi"]}, "maxItems": 2}},
     "required": ["title", "year", "genres"]},
    {"type": "object", "properties": {"lat": {"type": "number", "multipleOf": 0.25, "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "multipleOf": 0.25, "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 24}},
     "required": ["note"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
        "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {
        "type": "integer", "minimum": 0, "maximum": 50}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{2,8}$"}},
     "required": ["word"]},
    {"type": "object", "properties": {"first": S, "last": S, "middle": S},
     "required": ["first", "last"], "additionalProperties": False},
    {"type": "object", "properties": {"temps": {"type": "array", "items": {
        "type": "number", "multipleOf": 0.25, "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 3}},
     "required": ["temps"]},
    {"type": "object", "properties": {"choice": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}},
     "required": ["choice"]},
    {"type": "object", "properties": {"pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind", "legs"], "additionalProperties": False},
        "owner": S}, "required": ["pet", "owner"]},
]


def closed(schema):
    """additionalProperties false on every object, as OpenAI's strict mode requires: a schema
    that allows any extra key lets a model add keys without end."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            closed(value)
    elif isinstance(schema, list):
        for value in schema:
            closed(value)
    return schema


SCHEMAS = [closed(s) for s in SCHEMAS]
assert len(SCHEMAS) == 20 and len({json.dumps(s) for s in SCHEMAS}) == 20

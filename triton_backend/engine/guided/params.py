"""What a request asks of guided decoding, checked where it enters the engine. Pure Python.

The guide types are NVIDIA's (`guided_decoding_guide_type` of TensorRT-LLM's executor):
`json` (any JSON value; no guide), `json_schema` (a JSON Schema document), `regex` and
`ebnf_grammar` (GBNF, as llama.cpp and xgrammar write it: `root ::= ...`; a Lark grammar is
taken too). Every error names the wire field (`guided_decoding_guide_type` /
`guided_decoding_guide`) and the limit.
"""
from __future__ import annotations

from dataclasses import dataclass

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
# A guide is compiled while requests wait for it and held in the cache: its size is bounded so
# one request cannot hold the compiler or the memory (the parser's own limits bound the work).
MAX_GUIDE_CHARS = 64 * 1024

TYPE_FIELD = "guided_decoding_guide_type"
GUIDE_FIELD = "guided_decoding_guide"


@dataclass(frozen=True)
class GuidedDecodingParams:
    """`guide_type` one of GUIDE_TYPES; `guide` the schema, regex or grammar text ("" for json)."""

    guide_type: str
    guide: str = ""

    def __post_init__(self) -> None:
        if self.guide_type == "structural_tag":
            raise ValueError(f"{TYPE_FIELD}: structural_tag is not supported; use one of "
                             f"{', '.join(GUIDE_TYPES)}")
        if self.guide_type not in GUIDE_TYPES:
            raise ValueError(f"{TYPE_FIELD} must be one of {', '.join(GUIDE_TYPES)}, "
                             f"got {self.guide_type!r}")
        if not isinstance(self.guide, str):
            raise ValueError(f"{GUIDE_FIELD} must be a string, got {type(self.guide).__name__}")
        if len(self.guide) > MAX_GUIDE_CHARS:
            raise ValueError(f"{GUIDE_FIELD} has {len(self.guide)} characters, over the limit "
                             f"of {MAX_GUIDE_CHARS}")
        if self.guide_type == "json" and self.guide.strip():
            raise ValueError(f"{GUIDE_FIELD} must be empty for {TYPE_FIELD} json (any JSON "
                             f"value); send a schema with {TYPE_FIELD} json_schema")
        if self.guide_type != "json" and not self.guide.strip():
            raise ValueError(f"{GUIDE_FIELD} is required for {TYPE_FIELD} {self.guide_type}")

"""Guided decoding in the engine: guides checked and compiled once (LRU), masks applied per row
in mixed batches, the grammar state advanced through speculative drafts and kept across
preemption, and every output valid for its guide (tiny fp32 engines)."""
import json
import re

import jsonschema
import pytest

from test_speculative import speculative_engine
from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.guided import MAX_GUIDE_CHARS, GuidedDecodingParams
from triton_backend.engine.guided.compiler import GrammarCompiler, GuideError
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate
from triton_backend.engine.tokenizer import load_tokenizer

# (The `json` guide, any JSON value, is unbounded: a random model may write digits forever. The
# OpenAI end-to-end tests cover it with the demo model.)
# Schemas whose documents are bounded, so a random-weight model always completes them within
# max_tokens (strings and arrays have a maximum length, integers a range).
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 99}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": [1, 2, 3]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"outer": {
        "type": "object", "properties": {"inner": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "flag": {"type": "null"}},
        "required": ["inner", "flag"], "additionalProperties": False}},
     "required": ["outer"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
     "minItems": 1, "maxItems": 3},
]
REGEX = r"[0-9]{3}-[a-c]{2}"
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'


def _guide(kind: str, guide) -> GuidedDecodingParams:
    return GuidedDecodingParams(kind, guide if isinstance(guide, str) else json.dumps(guide))


def _text(engine_dir, ids: list[int]) -> str:
    return load_tokenizer(engine_dir).decode(ids, skip_special_tokens=True)


def _check_valid(engine_dir, request: Request, result) -> None:
    assert result.finish_reason == FinishReason.END_ID, (result, request.guided_decoding)
    text = _text(engine_dir, result.output_ids)
    params = request.guided_decoding
    if params.guide_type == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(params.guide))
    elif params.guide_type == "json":
        json.loads(text)
    elif params.guide_type == "regex":
        assert re.fullmatch(params.guide, text), text
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def _requests(n: int, guided_every: int = 1) -> list[Request]:
    guides = ([_guide("json_schema", s) for s in SCHEMAS]
              + [_guide("regex", REGEX), _guide("ebnf_grammar", EBNF)])
    out = []
    for i in range(n):
        sampling = SamplingParams(temperature=0.9, top_k=50, seed=i) if i % 2 else SamplingParams()
        prompt = [(7 * i + j) % 300 + 3 for j in range(5 + i % 7)]
        guide = guides[i % len(guides)] if i % guided_every == 0 else None
        out.append(Request(prompt, 120, sampling, streaming=bool(i % 3 == 0),
                           guided_decoding=guide))
    return out


# -- params and the compiler ---------------------------------------------------------------------
@pytest.mark.parametrize("kind, guide, message", [
    ("xml", "<a/>", "guided_decoding_guide_type must be one of json, json_schema, regex, "
                    "ebnf_grammar, got 'xml'"),
    ("structural_tag", "{}", "guided_decoding_guide_type: structural_tag is not supported"),
    ("regex", "", "guided_decoding_guide is required for guided_decoding_guide_type regex"),
    ("json", "{}", "guided_decoding_guide must be empty for guided_decoding_guide_type json"),
    ("regex", "a" * (MAX_GUIDE_CHARS + 1),
     f"guided_decoding_guide has {MAX_GUIDE_CHARS + 1} characters, over the limit of "
     f"{MAX_GUIDE_CHARS}"),
])
def test_params_refuse_bad_guides_naming_the_field(kind, guide, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GuidedDecodingParams(kind, guide)


@pytest.fixture(scope="module")
def compiler(tiny_engines):
    engine = LLMEngine(tiny_engines("llama_gqa"))
    return engine.grammars


@pytest.mark.parametrize("kind, guide, reason", [
    ("json_schema", "{not json", "the json_schema is not valid JSON"),
    ("json_schema", "[1, 2]", "a json_schema must be a JSON object, got list"),
    ("json_schema", '{"type": "no-such-type"}', "invalid json_schema: Invalid type: no-such-type"),
    ("regex", "a(b", "invalid regex"),
    ("ebnf_grammar", "root ::= undefined_rule", "invalid ebnf_grammar"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}',
     "invalid json_schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)"),
])
def test_bad_guides_are_refused_with_the_librarys_reason(compiler, kind, guide, reason):
    errors = compiler.get_stats()["guided_compile_errors"]
    with pytest.raises(GuideError, match=r"^guided_decoding_guide: ") as info:
        compiler.compile(GuidedDecodingParams(kind, guide))
    assert reason in str(info.value)
    assert compiler.get_stats()["guided_compile_errors"] == errors + 1


def test_grammars_compile_once_and_the_cache_is_lru(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    compiler = GrammarCompiler(engine_dir / "tokenizer", 384, [1], cache_size=2)
    a, b, c = (GuidedDecodingParams("regex", r) for r in ("a+", "b+", "c+"))
    compiler.new_matcher(a)
    compiler.new_matcher(a)
    compiler.new_matcher(b)
    assert compiler.get_stats()["guided_compiles"] == 2
    assert compiler.get_stats()["guided_cache_hits"] == 1
    compiler.new_matcher(a)  # a is now the most recently used: c evicts b
    compiler.new_matcher(c)
    compiler.new_matcher(a)
    stats = compiler.get_stats()
    assert (stats["guided_compiles"], stats["guided_cache_hits"]) == (3, 3)
    assert stats["guided_cache_entries"] == 2
    compiler.new_matcher(b)  # evicted: compiled again
    assert compiler.get_stats()["guided_compiles"] == 4


def test_a_compile_over_the_time_limit_is_refused(tiny_engines, monkeypatch):
    """A compile that does not finish in time is refused naming the limit; the caller is not
    held past it (a stand-in compile that blocks until released plays the slow grammar)."""
    import threading

    compiler = GrammarCompiler(tiny_engines("llama_gqa") / "tokenizer", 384, [1],
                               compile_timeout_s=0.05)
    release = threading.Event()
    monkeypatch.setattr(compiler, "_build", lambda *args: release.wait(60))
    try:
        with pytest.raises(GuideError, match=r"guided_decoding_guide: compiling the json_schema "
                                             r"took longer than the limit of 0.05 s"):
            compiler.compile(_guide("json_schema", SCHEMAS[3]))
    finally:
        release.set()
    assert compiler.get_stats()["guided_compile_errors"] == 1


# -- the engine ----------------------------------------------------------------------------------
def test_every_output_follows_its_guide_in_a_mixed_batch(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    requests = _requests(27, guided_every=1) + _requests(9, guided_every=1000)[1:]
    engine = LLMEngine(engine_dir)
    results = generate(engine, requests)
    for request, result in zip(requests, results):
        if request.guided_decoding is not None:
            _check_valid(engine_dir, request, result)
    # Unguided rows are untouched by their neighbours' masks: each equals its solo run.
    for request, result in zip(requests, results):
        if request.guided_decoding is None:
            solo = generate(LLMEngine(engine_dir), [request])[0]
            assert solo.output_ids == result.output_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    stats = engine.get_stats()
    assert stats["guided_compiles"] == len(SCHEMAS) + 2
    assert stats["guided_cache_hits"] == 27 - stats["guided_compiles"]


def test_an_unconstrained_run_would_not_have_been_valid(tiny_engines):
    """The masks do the work: without them the same requests produce no valid document."""
    engine_dir = tiny_engines("llama_gqa")
    requests = _requests(9)
    free = [Request(r.input_token_ids, 40, r.sampling) for r in requests]
    for request, result in zip(requests, generate(LLMEngine(engine_dir), free)):
        with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError)):
            _check_valid(engine_dir, request, result)


def test_guided_output_is_the_same_with_speculation(tiny_engines, tmp_path):
    """Drafts the grammar rejects end the accepted run: greedy guided output is token for token
    the output without speculation, and drafts were both accepted and cut."""
    engine_dir = tiny_engines("llama_gqa")
    spec_dir = speculative_engine(engine_dir, tmp_path, "ngram", mode="ngram", num_draft_tokens=4,
                                  prompt_lookup_min=1, prompt_lookup_max=3)
    requests = []
    for i, schema in enumerate(SCHEMAS + [{"type": "array", "items": {"enum": ["ab", "abc"]},
                                           "maxItems": 6}]):
        # The prompt holds a valid document, so prompt lookup proposes plausible drafts.
        doc = load_tokenizer(engine_dir).encode(json.dumps(_example(schema)))
        requests.append(Request(doc * 3, 80, guided_decoding=_guide("json_schema", schema),
                                streaming=bool(i % 2)))
    requests.append(Request([5, 6, 7, 5, 6, 7, 5, 6], 30, guided_decoding=_guide("regex", REGEX)))
    plain = generate(LLMEngine(engine_dir), requests)
    engine = LLMEngine(spec_dir)
    speculative = generate(engine, requests)
    for request, a, b in zip(requests, plain, speculative):
        assert a.output_ids == b.output_ids
        _check_valid(engine_dir, request, b)
    stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def _example(schema: dict):
    examples = {0: {"ok": True}, 1: {"n": 7}, 2: {"color": "red", "size": 2},
                3: {"name": "ab", "tags": ["x"]}, 4: {"outer": {"inner": 3, "flag": None}},
                5: [1, 2]}
    return examples.get(SCHEMAS.index(schema), ["ab", "abc"]) if schema in SCHEMAS \
        else ["ab", "abc"]


def test_guided_output_survives_preemption(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    requests = [Request([(i * 13 + j) % 300 + 3 for j in range(20)], 80,
                        guided_decoding=_guide("json_schema", SCHEMAS[3 + i % 3]))
                for i in range(8)]
    roomy = generate(LLMEngine(engine_dir), requests)
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=14, enable_prefix_caching=False)
    tight = generate(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, a, b in zip(requests, roomy, tight):
        assert a.output_ids == b.output_ids
        _check_valid(engine_dir, request, b)


def test_a_request_end_id_replaces_the_grammars_end(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    request = Request([4, 5, 6], 40, end_ids=[7], guided_decoding=_guide("regex", "ab"))
    result = generate(LLMEngine(engine_dir), [request])[0]
    assert result.finish_reason == FinishReason.END_ID
    assert _text(engine_dir, result.output_ids) == "ab"


def test_a_bad_guide_is_refused_at_validation_and_the_engine_goes_on(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    engine = LLMEngine(engine_dir)
    with pytest.raises(ValueError, match=r"guided_decoding_guide: invalid regex"):
        engine.validate(Request([3, 4], 8, guided_decoding=GuidedDecodingParams("regex", "(")))
    result = generate(engine, [Request([3, 4], 40, guided_decoding=_guide("regex", REGEX))])[0]
    assert re.fullmatch(REGEX, _text(engine_dir, result.output_ids))


def test_grammar_state_replays_the_tokens_when_it_falls_out_of_step(compiler, tiny_engines):
    """The recompute path: a state that does not match the sequence's tokens starts again from
    the grammar's start and replays them."""
    from triton_backend.engine.guided.state import GrammarState

    tokenizer = load_tokenizer(tiny_engines("llama_gqa"))
    ids = tokenizer.encode("123-a", add_special_tokens=False)
    state = GrammarState(compiler.new_matcher(GuidedDecodingParams("regex", REGEX)),
                         frozenset([1]), compiler.tokenizer.vocab_size)
    for token in ids:
        state.accept(token)
    state.sync(ids, frozenset([1]))
    assert state.num_resyncs == 0
    state.sync(ids[:2], frozenset([1]))  # the sequence holds fewer tokens than were consumed
    assert (state.num_resyncs, state.num_consumed) == (1, 2)
    for token in ids[2:]:
        state.accept(token)
    assert not state.is_complete()
    state.accept(tokenizer.encode("b", add_special_tokens=False)[0])
    assert state.is_complete()

"""Guides -> compiled grammars, once per distinct guide, held in an LRU cache.

A compiled grammar is an llguidance matcher at its start state, checked by computing its first
mask; each sequence takes a copy (`GrammarState`). Compiling happens where a request is
validated (the caller's thread, or the engine process's reader thread), not in the step loop;
the loop only copies. Compiling is bounded: the guide's size (`MAX_GUIDE_CHARS`), the parser's
own limits (lexer fuel, grammar size), and a wall-clock timeout after which the request is
refused naming the limit.

Counters: `guided_compiles` (cache misses, each a compile), `guided_cache_hits` (requests that
found their grammar compiled), `guided_compile_errors`, `guided_compile_seconds` (total),
`guided_cache_entries`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from triton_backend.engine.guided.params import GUIDE_FIELD, GuidedDecodingParams

DEFAULT_CACHE_SIZE = 128
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# JSON is written the way json.dumps writes it: no free whitespace, which a small model may
# otherwise fill without end between two tokens of the document.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A guide that does not compile; the message names the field and the library's reason."""


@dataclass
class CompiledGrammar:
    template: object      # llguidance.LLMatcher at the start state; copied, never advanced
    compile_seconds: float
    num_uses: int = 0


class GrammarCompiler:
    """Thread-safe. `eos_ids`: the engine's end ids (the grammar allows them where it may end);
    `vocab_size`: the logits' width."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_ids: list[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._cache: collections.OrderedDict[GuidedDecodingParams, CompiledGrammar] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.stats = {"guided_compiles": 0, "guided_cache_hits": 0, "guided_compile_errors": 0,
                      "guided_compile_seconds": 0.0, "guided_requests": 0}

    @property
    def tokenizer(self):
        """The llguidance tokenizer (built once, about 0.2 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, params: GuidedDecodingParams) -> CompiledGrammar:
        """The compiled grammar of `params`, from the cache or compiled now. Raises GuideError."""
        with self._lock:
            entry = self._cache.get(params)
            if entry is not None:
                self._cache.move_to_end(params)
                return entry
        started = time.perf_counter()
        try:
            template = self._compile_bounded(params)
        except GuideError:
            with self._lock:
                self.stats["guided_compile_errors"] += 1
            raise
        entry = CompiledGrammar(template, time.perf_counter() - started)
        with self._lock:
            self.stats["guided_compiles"] += 1
            self.stats["guided_compile_seconds"] += entry.compile_seconds
            self._cache[params] = entry
            self._cache.move_to_end(params)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry

    def new_matcher(self, params: GuidedDecodingParams):
        """A fresh matcher for one request (counted as a cache hit when its grammar had served
        a request before)."""
        entry = self.compile(params)
        with self._lock:
            self.stats["guided_requests"] += 1
            if entry.num_uses:
                self.stats["guided_cache_hits"] += 1
            entry.num_uses += 1
        return entry.template.deep_copy()

    def get_stats(self) -> dict:
        with self._lock:
            return dict(self.stats, guided_cache_entries=len(self._cache))

    def _compile_bounded(self, params: GuidedDecodingParams):
        tokenizer = self.tokenizer
        grammar = grammar_text(params)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "llm-forge-grammar")
        future = self._pool.submit(self._build, tokenizer, grammar, params)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise GuideError(f"{GUIDE_FIELD}: compiling the {params.guide_type} took longer than "
                             f"the limit of {self.compile_timeout_s:g} s") from None

    def _build(self, tokenizer, grammar: str, params: GuidedDecodingParams):
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GuideError(f"{GUIDE_FIELD}: invalid {params.guide_type}: "
                             f"{matcher.get_error().strip()}")
        mask = allocate_token_bitmask(1, tokenizer.vocab_size)
        fill_next_token_bitmask(matcher.deep_copy(), mask, 0)
        if not mask.any():
            raise GuideError(f"{GUIDE_FIELD}: the {params.guide_type} allows no output at all")
        return matcher


def grammar_text(params: GuidedDecodingParams) -> str:
    """The llguidance grammar of a guide. Raises GuideError naming the field."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.guide_type
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            try:
                schema = json.loads(params.guide)
            except json.JSONDecodeError as exc:
                raise GuideError(f"{GUIDE_FIELD}: the json_schema is not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise GuideError(f"{GUIDE_FIELD}: a json_schema must be a JSON object, got "
                                 f"{type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.guide)
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.guide))
    except GuideError:
        raise
    except Exception as exc:  # the library's own message, under our field name
        raise GuideError(f"{GUIDE_FIELD}: invalid {kind}: {exc}") from None

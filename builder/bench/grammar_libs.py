"""`forge bench grammar-libs`: the grammar libraries on PyPI for guided decoding, with one
engine's tokenizer (the measurement that chose llguidance). For each one that imports: the
tokenizer setup, the first compile of a JSON schema, the mean time to fill the token masks of 16
sequences walking through a valid document (one mask per sequence per step, then the token is
accepted), and whether it takes a regex and an EBNF grammar. The libraries are not dependencies
of llm-forge: install the ones to compare first."""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

from builder.bench.summary import Table, document

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]},
        "status": {"enum": ["active", "inactive", "banned"]}},
    "required": ["name", "age", "status"]}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                       "tags": ["math", "engines"], "address": {
                           "street": "St James's Square", "city": "London", "zip": "12345"},
                       "status": "active"})
REGEX, EBNF, ROWS = r"[0-9]{3}-[0-9]{4}", 'root ::= "yes" | "no" | [0-9]+', 16


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _walk(tokenizer: Any, steps: int, fill: Callable[[], None], accept: Callable[[int], None]
          ) -> list[float]:
    times = []
    for token in tokenizer.encode(DOCUMENT, add_special_tokens=False)[:steps]:
        times.append(_timed(fill)[1])
        accept(token)
    return times


def llguidance(tokenizer: Any, vocab_size: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance._grammar_from import grammar_from
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    lltok, setup = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers, compile_s = _timed(lambda: [llguidance.LLMatcher(lltok, grammar)
                                          for _ in range(ROWS)])
    executor, mask = llguidance.LLExecutor(num_threads=1), allocate_token_bitmask(ROWS, vocab_size)
    times = _walk(tokenizer, steps, lambda: fill_next_token_bitmask_par(
        executor, [(m, i) for i, m in enumerate(matchers)], mask),
        lambda token: [m.consume_token(token) for m in matchers])
    regex = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex(REGEX))
    ebnf = llguidance.LLMatcher(lltok, grammar_from("ebnf", EBNF))
    return {"setup_s": setup, "compile_s": compile_s / ROWS, "mask_s": times,
            "regex": not regex.is_error(), "ebnf": not ebnf.is_error()}


def xgrammar(tokenizer: Any, vocab_size: int, steps: int) -> dict:
    import xgrammar as xgr

    compiler, setup = _timed(lambda: xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size), max_threads=1,
        cache_enabled=False))
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    mask = xgr.allocate_token_bitmask(ROWS, vocab_size)
    times = _walk(tokenizer, steps, lambda: [m.fill_next_token_bitmask(mask, i)
                                             for i, m in enumerate(matchers)],
                  lambda token: [m.accept_token(token) for m in matchers])
    return {"setup_s": setup, "compile_s": compile_s, "mask_s": times,
            "regex": compiler.compile_regex(REGEX) is not None,
            "ebnf": compiler.compile_grammar(EBNF) is not None}


def outlines_core(tokenizer: Any, vocab_size: int, steps: int) -> dict:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Any:
        decoder, entries = _byte_decoder(), {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id != tokenizer.eos_token_id and token_id not in tokenizer.all_special_ids:
                text = bytes(decoder.get(c, 0) for c in token).decode("utf-8", errors="replace")
                entries.setdefault(text, []).append(token_id)
        return Vocabulary(tokenizer.eos_token_id, entries)

    vocab, setup = _timed(vocabulary)
    index, compile_s = _timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
    guides = [Guide(index) for _ in range(ROWS)]
    mask = torch.zeros(ROWS, (vocab_size + 31) // 32, dtype=torch.int32)
    times = _walk(tokenizer, steps, lambda: [
        g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())
        for i, g in enumerate(guides)], lambda token: [g.advance(token) for g in guides])
    return {"setup_s": setup, "compile_s": compile_s, "mask_s": times, "regex": True,
            "ebnf": False}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def run(tokenizer_dir: str, steps: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab_size = len(tokenizer)
    table = Table(["library", "tokenizer setup s", "JSON schema compile ms",
                   f"mask ms per step ({ROWS} rows), mean (p90)", "regex", "EBNF"])
    results: dict[str, Any] = {}
    for name, bench in (("llguidance", llguidance), ("xgrammar", xgrammar),
                        ("outlines-core", outlines_core)):
        try:
            r = results[name] = bench(tokenizer, vocab_size, steps)
        except ImportError as exc:
            table.add(name, f"not installed ({exc})", "", "", "", "")
            continue
        times = sorted(r["mask_s"])
        table.add(name, f"{r['setup_s']:.2f}", f"{r['compile_s'] * 1e3:.1f}",
                  f"{statistics.mean(times) * 1e3:.3f} ({times[int(len(times) * 0.9)] * 1e3:.3f})",
                  r["regex"], r["ebnf"])
    return document("forge bench grammar-libs", {"tokenizer": tokenizer_dir, "steps": steps,
                                                 "vocab_size": vocab_size, "rows": ROWS},
                    [table], [f"{steps} steps of a valid document"], results=results)

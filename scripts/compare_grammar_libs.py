"""Compare the grammar libraries on PyPI for guided decoding with the demo model's tokenizer.

For each library that imports: the first compile of a JSON schema (tokenizer setup apart), the
mean time to fill the token masks of a batch of 16 sequences walking through a valid document
(one mask per sequence per step, then the token is accepted), and whether it handles a regex and
an EBNF grammar. Install size is measured beside it (`pip install --target DIR --no-deps`, `du`).

    python scripts/compare_grammar_libs.py --tokenizer DIR [--steps 40]

The libraries are not dependencies of the project; install the ones to compare first (each
into a directory on PYTHONPATH is enough).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"]},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "status"],
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                       "tags": ["math", "engines"],
                       "address": {"street": "St James's Square", "city": "London",
                                   "zip": "12345"}, "status": "active"})
REGEX = r"[0-9]{3}-[0-9]{4}"
EBNF = 'root ::= "yes" | "no" | [0-9]+'


def _walk(tokenizer, steps: int) -> list[int]:
    return tokenizer.encode(DOCUMENT, add_special_tokens=False)[:steps]


def bench_llguidance(tokenizer, vocab_size: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(16)]
    compile_s = (time.perf_counter() - start) / 16
    executor = llguidance.LLExecutor(num_threads=1)
    mask = allocate_token_bitmask(16, vocab_size)
    times = []
    for token in _walk(tokenizer, steps):
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        times.append(time.perf_counter() - start)
        assert (mask[0, token // 32] >> (token % 32)) & 1, "the valid document was masked"
        for m in matchers:
            m.consume_token(token)
    regex = not llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex(REGEX)).is_error()
    from llguidance._grammar_from import grammar_from

    ebnf = not llguidance.LLMatcher(lltok, grammar_from("ebnf", EBNF)).is_error()
    del np
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_ms": _ms(times),
            "regex": regex, "ebnf": ebnf}


def bench_xgrammar(tokenizer, vocab_size: int, steps: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(16)]
    mask = xgr.allocate_token_bitmask(16, vocab_size)
    times = []
    for token in _walk(tokenizer, steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        times.append(time.perf_counter() - start)
        for m in matchers:
            assert m.accept_token(token), "the valid document was refused"
    regex = compiler.compile_regex(REGEX) is not None
    ebnf = compiler.compile_grammar(EBNF) is not None
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_ms": _ms(times),
            "regex": regex, "ebnf": ebnf}


def bench_outlines_core(tokenizer, vocab_size: int, steps: int) -> dict:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    eos = tokenizer.eos_token_id
    byte_decoder = _byte_decoder()
    entries: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id == eos or token_id in tokenizer.all_special_ids:
            continue
        text = bytes(byte_decoder.get(c, 0) for c in token).decode("utf-8", errors="replace")
        entries.setdefault(text, []).append(token_id)
    vocabulary = Vocabulary(eos, entries)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    compile_s = time.perf_counter() - start
    guides = [Guide(index) for _ in range(16)]
    mask = torch.zeros(16, (vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in _walk(tokenizer, steps):
        start = time.perf_counter()
        for i, g in enumerate(guides):
            g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())
        times.append(time.perf_counter() - start)
        for g in guides:
            g.advance(token)
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_ms": _ms(times),
            "regex": True, "ebnf": False}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def _ms(times: list[float]) -> str:
    return f"{statistics.mean(times) * 1e3:.3f} (p90 {sorted(times)[int(len(times) * 0.9)] * 1e3:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    print(f"tokenizer vocab {vocab_size}, batch 16, {args.steps} steps of a valid document")
    print("| library | tokenizer setup s | JSON schema compile ms | mask ms per step (16 rows) | regex | EBNF |")
    print("|---|---|---|---|---|---|")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines_core)):
        try:
            r = bench(tokenizer, vocab_size, args.steps)
        except ImportError as exc:
            print(f"| {name} | not installed ({exc}) | | | | |")
            continue
        print(f"| {name} | {r['tokenizer_setup_s']:.2f} | {r['compile_s'] * 1e3:.1f} | "
              f"{r['mask_ms']} | {r['regex']} | {r['ebnf']} |")


if __name__ == "__main__":
    main()

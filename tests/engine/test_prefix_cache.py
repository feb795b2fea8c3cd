"""Prefix caching in the engine: the same tokens with the cache on and off (fp32), under
preemption, cancellation, chunked prefill, fully cached prompts and one-byte KV caches; no
block leaks after any of it."""
import random

import pytest
import tiny

from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.llm_engine import LLMEngine, cache_salt
from triton_backend.engine.offline import generate


def _mixed_requests(n: int = 50, seed: int = 0) -> list[Request]:
    """Requests over three shared system prompts (one longer than a step's budget in the tight
    case), unique tails of 1-20 tokens, greedy and seeded sampling, streamed or not."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 380) for _ in range(length)] for length in (40, 64, 77)]
    out = []
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(3, 380) for _ in range(rng.randint(1, 20))]
        sampling = SamplingParams() if i % 5 else SamplingParams(temperature=0.9, top_k=30,
                                                                 seed=500 + i)
        out.append(Request(prompt, rng.randint(1, 30), sampling, streaming=bool(i % 2),
                           ignore_eos=True))
    return out


def _drive(engine: LLMEngine, requests: list[Request], arrivals: list[int],
           cancel_after: dict[int, int]) -> dict[int, list[int]]:
    """Submit request i at step arrivals[i]; cancel request i once it has streamed
    cancel_after[i] responses. Returns every request's output tokens."""
    outputs: dict[int, list[int]] = {}
    ids: dict[int, int] = {}
    seen: dict[int, int] = {}
    done: set[int] = set()
    step = 0
    while len(done) < len(requests):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = engine.add_request(requests[i])
        by_rid = {rid: i for i, rid in ids.items()}
        for response in engine.step():
            i = by_rid[response.request_id]
            outputs.setdefault(i, []).extend(response.output_token_ids)
            seen[i] = seen.get(i, 0) + 1
            if response.is_final:
                done.add(i)
            elif i in cancel_after and seen[i] >= cancel_after[i]:
                final = engine.abort(response.request_id)
                outputs[i].extend(final.output_token_ids)
                done.add(i)
        step += 1
        assert step < 5000, "engine did not finish"
    return outputs


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert set(bm.ref_counts) == {0} and not engine.sequences
    assert len(bm.free_block_ids) + len(bm.reusable_block_ids) == bm.num_blocks
    assert set(bm.cached_block_ids.values()) == set(bm.reusable_block_ids)


@pytest.mark.parametrize("kv_cache_num_blocks,max_num_tokens", [(256, 256), (24, 48)],
                         ids=["roomy", "preempting-chunked"])
def test_fifty_mixed_requests_give_the_same_tokens_with_the_cache_on_and_off(
        tiny_engines, kv_cache_num_blocks, max_num_tokens):
    engine_dir = tiny_engines("llama_gqa")
    requests = _mixed_requests()
    arrivals = [random.Random(100 + i).randint(0, 60) for i in range(len(requests))]
    cancel_after = {i: 2 + i % 3 for i in range(3, len(requests), 9) if requests[i].streaming}
    results = {}
    for caching in (True, False):
        engine = LLMEngine(engine_dir, kv_cache_num_blocks=kv_cache_num_blocks,
                           enable_prefix_caching=caching)
        engine.scheduler.max_num_tokens = max_num_tokens
        # the same schedule in every run: no prefill room sized by measured step times
        engine.scheduler.target_itl_ms = 0
        results[caching] = _drive(engine, requests, arrivals, cancel_after)
        assert_no_leaks(engine)
        stats = engine.get_stats()
        if caching:
            assert stats["prefix_cache_hit_rate"] > 0.5, stats
            cached_stats = stats
        else:
            assert stats["prefix_cache_hit_tokens"] == 0 and stats["num_cached_blocks"] == 0
    full = {i: generate(LLMEngine(engine_dir, kv_cache_num_blocks=64, enable_prefix_caching=False),
                        [requests[i]])[0].output_ids for i in cancel_after}
    for i in range(len(requests)):
        if i in cancel_after:  # cancelled at different steps: each a prefix of the full output
            for caching in (True, False):
                got = results[caching][i]
                assert len(got) < len(full[i]) and got == full[i][:len(got)]
        else:
            assert results[True][i] == results[False][i], f"request {i}"
    if kv_cache_num_blocks == 24:
        assert cached_stats["num_preemptions"] > 0 and cached_stats["num_evicted_blocks"] > 0


def test_fully_cached_prompt_and_partial_last_block(tiny_engines):
    engine_dir = tiny_engines("mistral")
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=64)
    off = LLMEngine(engine_dir, kv_cache_num_blocks=64, enable_prefix_caching=False)
    full_blocks = list(range(10, 42))      # 32 tokens = 4 full blocks of 8
    partial = list(range(50, 71))          # 21 tokens: 2 full blocks and 5 more
    for prompt in (full_blocks, partial):
        expected = generate(off, [Request(prompt, 12, ignore_eos=True)])[0].output_ids
        first = generate(engine, [Request(prompt, 12, ignore_eos=True)])[0].output_ids
        hits_before = engine.get_stats()["prefix_cache_hit_tokens"]
        again = generate(engine, [Request(prompt, 12, ignore_eos=True)])[0].output_ids
        assert first == again == expected
        hit = engine.get_stats()["prefix_cache_hit_tokens"] - hits_before
        # all full blocks but the one holding the last prompt token, which is computed again
        assert hit == 8 * ((len(prompt) - 1) // 8)
    assert_no_leaks(engine)


def test_streamed_request_reports_reused_and_new_blocks(tiny_engines):
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=64)
    prompt = list(range(3, 43))            # 40 tokens = 5 blocks
    generate(engine, [Request(prompt, 4, ignore_eos=True)])
    rid = engine.add_request(Request(prompt + [7, 8], 6, streaming=True, ignore_eos=True))
    finals = []
    while engine.has_work():
        finals += [r for r in engine.step() if r.request_id == rid and r.is_final]
    # 42 + 6 tokens need 6 blocks; 5 came from the cache
    assert finals[0].num_reused_blocks == 5 and finals[0].num_new_blocks == 1


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_one_byte_kv_cache_reuse_equals_prefill_chunked_at_the_same_boundary(
        tiny_engines, tmp_path, kv_dtype):
    """A reused prefix is read back dequantized, exactly as a second prefill chunk reads the
    first: the cache-on engine must match the cache-off engine chunking at the same token."""
    engine_dir = tiny.one_byte_kv_engine(tiny_engines("llama_gqa"), tmp_path, kv_dtype)
    system = [random.Random(1).randrange(3, 380) for _ in range(32)]  # 4 blocks
    first, second = system + [5, 6, 7, 8, 9], system + [11, 12, 13]
    engines = {}
    for caching in (True, False):
        engines[caching] = LLMEngine(engine_dir, kv_cache_num_blocks=64, enable_prefix_caching=caching)
        engines[caching].scheduler.max_num_tokens = len(system)  # chunk boundary at the prefix
        generate(engines[caching], [Request(first, 8, ignore_eos=True)])
    outputs = {c: generate(e, [Request(second, 16, ignore_eos=True)])[0].output_ids
               for c, e in engines.items()}
    assert outputs[True] == outputs[False]
    assert engines[True].get_stats()["prefix_cache_hit_tokens"] == 32
    for engine in engines.values():
        assert_no_leaks(engine)


def test_the_cache_salt_names_what_changes_the_kv(tiny_engines):
    from triton_backend.engine.config import EngineConfig

    config = EngineConfig.load(tiny_engines("llama_gqa"))
    salts = {cache_salt(config)}
    config.kv_cache.dtype = "int8"
    salts.add(cache_salt(config))
    config.quantization.weights = "int4_awq"
    salts.add(cache_salt(config))
    config.name = "another-engine"
    salts.add(cache_salt(config))
    assert len(salts) == 4

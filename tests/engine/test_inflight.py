"""In-flight batching: requests that join and leave at different steps give exactly the ids they
give alone, also when the KV pool is so small that sequences are preempted and recomputed."""
import random

import pytest

from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate


def _requests(seed: int, n: int = 18) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randint(1, 60))]
        sampling = SamplingParams() if i % 3 else SamplingParams(temperature=0.8, top_k=20,
                                                                 top_p=0.9, seed=1000 + i)
        out.append(Request(prompt, rng.randint(1, 40), sampling, streaming=bool(i % 2),
                           ignore_eos=True))
    return out


def _alone(engine_dir, requests):
    return [generate(LLMEngine(engine_dir, kv_cache_num_blocks=64), [r])[0].output_ids for r in requests]


def _staggered(engine: LLMEngine, requests: list[Request], arrivals: list[int]):
    """Submit request i at step arrivals[i]; collect streamed + final outputs per request."""
    outputs: dict[int, list[int]] = {}
    finals: dict[int, list[int]] = {}
    ids: dict[int, int] = {}
    step, max_batch = 0, 0
    while len(finals) < len(requests):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = engine.add_request(requests[i])
        for response in engine.step():
            outputs.setdefault(response.request_id, []).extend(response.output_token_ids)
            if response.is_final:
                finals[response.request_id] = outputs[response.request_id]
        max_batch = max(max_batch, len(engine.scheduler.running))
        step += 1
        assert step < 5000, "engine did not finish"
    return [finals[ids[i]] for i in range(len(requests))], max_batch


@pytest.mark.parametrize("shape", ["llama_gqa", "qwen3_qk_norm"])
@pytest.mark.parametrize("kv_cache_num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_staggered_requests_match_their_solo_runs(tiny_engines, kv_cache_num_blocks, shape):
    engine_dir = tiny_engines(shape)
    requests = _requests(seed=kv_cache_num_blocks)
    expected = _alone(engine_dir, requests)
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=kv_cache_num_blocks)
    arrivals = [random.Random(i).randint(0, 30) for i in range(len(requests))]
    got, max_batch = _staggered(engine, requests, arrivals)
    assert got == expected
    assert max_batch >= 4, "requests never shared a step"
    if kv_cache_num_blocks == 14:
        assert engine.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    else:
        assert engine.scheduler.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == kv_cache_num_blocks
    assert not engine.sequences


def test_cancel_mid_stream_frees_blocks_and_others_continue(tiny_engines):
    engine_dir = tiny_engines("mistral")
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=64)
    keep = Request(list(range(3, 30)), 30, streaming=True, ignore_eos=True)
    expected = generate(LLMEngine(engine_dir, kv_cache_num_blocks=64), [keep])[0].output_ids
    victim = engine.add_request(Request(list(range(40, 90)), 60, streaming=True, ignore_eos=True))
    kept = engine.add_request(keep)
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    final = engine.abort(victim)
    assert final.is_final and final.finish_reason == FinishReason.CANCELLED
    assert final.num_output_tokens == 5
    outputs = []
    while engine.has_work():
        for r in engine.step():
            assert r.request_id == kept
            outputs.append(r)
    assert outputs[-1].is_final
    streamed = [t for r in outputs for t in r.output_token_ids]
    assert len(streamed) == 30 - 5 and expected[5:] == streamed
    assert engine.block_manager.num_free_blocks == 64


def test_end_ids_stop_words_and_min_tokens(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    prompt = list(range(3, 30))
    free_run = generate(LLMEngine(engine_dir), [Request(prompt, 30, ignore_eos=True)])[0].output_ids
    stop_at, eos = free_run[6], free_run[4]
    engine = LLMEngine(engine_dir)
    results = generate(engine, [
        Request(prompt, 30, end_ids=[eos]),
        Request(prompt, 30, end_ids=[]),
        Request(prompt, 30, end_ids=[], stop_token_sequences=[free_run[5:7]]),
        Request(prompt, 30, end_ids=[eos], sampling=SamplingParams(min_tokens=10)),
    ])
    first_eos = free_run.index(eos)
    assert results[0].output_ids == free_run[:first_eos + 1]
    assert results[0].finish_reason == FinishReason.END_ID
    assert results[1].output_ids == free_run and results[1].finish_reason == FinishReason.LENGTH
    assert results[2].output_ids == free_run[:7] and results[2].finish_reason == FinishReason.STOP_WORDS
    # min_tokens masks the end id until 10 tokens exist, so the run diverges from free_run there
    assert len(results[3].output_ids) >= 10
    assert eos not in results[3].output_ids[:10]
    assert stop_at is not None


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_engines):
    engine_dir = tiny_engines("qwen2_bias_tied")
    prompt = list(range(3, 20))

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return generate(LLMEngine(engine_dir), [Request(prompt, 24, params, ignore_eos=True)])[0]

    assert run(7).output_ids == run(7).output_ids
    assert run(7).output_ids != run(8).output_ids


def test_penalties_and_bad_words_change_greedy_output(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    prompt = list(range(3, 30))
    base = generate(LLMEngine(engine_dir), [Request(prompt, 30, ignore_eos=True)])[0].output_ids
    banned = base[3]
    engine = LLMEngine(engine_dir)
    no_bad, repeat = generate(engine, [
        Request(prompt, 30, ignore_eos=True, bad_token_sequences=[[banned]]),
        Request(prompt, 30, SamplingParams(frequency_penalty=100.0), ignore_eos=True),
    ])
    assert banned not in no_bad.output_ids and no_bad.output_ids[:3] == base[:3]
    assert len(set(repeat.output_ids)) == len(repeat.output_ids), "frequency penalty must forbid repeats"

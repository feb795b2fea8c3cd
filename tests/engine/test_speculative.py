"""Speculative decoding: prompt-lookup proposals, the verifier's rules, and the engine with
drafts giving the same greedy tokens as without (fp32), for mixed in-flight batches."""
import json
import random
import shutil

import pytest
import torch

from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.config import SpeculativeConfig
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate
from triton_backend.engine.sampler import Sampler
from triton_backend.engine.scheduler import ScheduledChunk
from triton_backend.engine.speculative.ngram import NgramIndex
from triton_backend.engine.speculative.verifier import accept_greedy, rejection_sample


# -- prompt lookup -----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    # (5, 6) ended at 2 and 7; "5 6" now again: the longest n that matches (2; no earlier
    # "2 5 6") at its latest earlier occurrence, followed by 7, 1, 2.
    assert index.propose(tokens, 3) == [7, 1, 2]
    tokens.append(7)                      # "5 6 7" occurs at 0 and 5: latest wins -> 1, 2, 5
    assert index.propose(tokens, 3) == [1, 2, 5]
    assert index.propose([1, 2, 3], 4) == []  # nothing repeats (the suffix never matches itself)


def test_ngram_respects_min_n_and_proposes_up_to_the_end():
    assert NgramIndex(min_n=2, max_n=3).propose([4, 1, 2, 3, 9, 1], 4) == []
    assert NgramIndex(min_n=1, max_n=3).propose([4, 1, 2, 3, 9, 1], 4) == [2, 3, 9, 1]
    assert NgramIndex(min_n=1, max_n=1).propose([4, 1, 2, 1], 9) == [2, 1]


# -- the verifier --------------------------------------------------------------------------------
def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    picks = [(3, -0.1), (4, -0.2), (9, -0.3), (6, -0.4)]
    assert accept_greedy([3, 4, 5], picks) == ([(3, -0.1), (4, -0.2)], (9, -0.3))
    assert accept_greedy([3, 4, 9], picks) == (picks[:3], (6, -0.4))  # all kept + a bonus
    assert accept_greedy([1, 4, 9], picks) == ([], (3, -0.1))


def _chunk(drafts: list[int], sampling: SamplingParams, seq_id: int = 1) -> ScheduledChunk:
    return ScheduledChunk(seq_id=seq_id, new_token_ids=[0] + drafts, num_computed_tokens=3,
                          block_table=[0], needs_sample=True,
                          request=Request([1, 2, 3], 16, sampling), token_ids=[1, 2, 3, 0],
                          num_prompt_tokens=3, num_draft_tokens=len(drafts))


def _chi_square(counts: dict[int, int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` over tokens with mass, and its dof."""
    total = sum(counts.values())
    support = [t for t in range(len(probs)) if probs[t] > 0]
    assert set(counts) <= set(support), "a token outside the target's support was emitted"
    stat = sum((counts.get(t, 0) - total * float(probs[t])) ** 2 / (total * float(probs[t]))
               for t in support)
    return stat, len(support) - 1


CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square quantiles at p = 0.999


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_emits_the_target_distribution(top_k):
    """Drafts of high, low and zero target probability: every emitted position is distributed
    as the target (temperature, top-k) at that position, whatever the drafts were."""
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                         [0.0, 2.5, 0.0, 1.0, 0.5, -2.0],
                         [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    sampling = SamplingParams(temperature=0.8, top_k=top_k, seed=7)
    sampler = Sampler()
    first, second, bonus = {}, {}, {}
    for _ in range(12000):
        kept, (token, _) = rejection_sample(sampler, rows, _chunk([1, 4], sampling), frozenset())
        out = [t for t, _ in kept] + [token]
        first[out[0]] = first.get(out[0], 0) + 1
        if len(out) > 1:                  # position 2 exists only after accepting draft 1
            second[out[1]] = second.get(out[1], 0) + 1
        if len(out) > 2:
            bonus[out[2]] = bonus.get(out[2], 0) + 1
    for row, counts in zip(rows, (first, second, bonus)):
        _, candidates = sampler.target_logits(row, _chunk([], sampling), frozenset())
        stat, dof = _chi_square(counts, torch.softmax(candidates, dim=-1))
        assert stat < CHI2_999[dof], (counts, stat)
    assert sum(second.values()) > 1000 and sum(bonus.values()) > 100


# -- the engine ----------------------------------------------------------------------------------
def speculative_engine(engine_dir, tmp_path, name: str = "ngram", **speculative) -> str:
    """A copy of `engine_dir` whose config.json turns speculation on."""
    copy = tmp_path / f"engine-{name}"
    shutil.copytree(engine_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["speculative"] = {"disable_by_batch_size": 64, **speculative}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _mixed_requests(engine_dir, n: int, seed: int) -> list[Request]:
    """Prompts that repeat themselves (so lookups hit); greedy requests that stop on a stop word
    or an end id taken from their own free run (so they do stop, also inside an accepted run),
    the end id masked by min_tokens, a frequency penalty; seeded sampling; streamed or not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 380) for _ in range(rng.randint(2, 9))]
        prompt = (motif * 12)[:rng.randint(8, 70)]
        sampling = {0: SamplingParams(temperature=0.9, top_k=40, seed=i),
                    1: SamplingParams(min_tokens=6),
                    2: SamplingParams(frequency_penalty=0.5)}.get(i % 6, SamplingParams())
        out.append(Request(prompt, rng.randint(8, 40), sampling, streaming=bool(i % 2),
                           end_ids=[]))
    free_runs = generate(LLMEngine(engine_dir, enable_speculative_decoding=False), out)
    for i, (request, run) in enumerate(zip(out, free_runs)):
        if i % 6 == 1:
            request.end_ids = [run.output_ids[2]]        # masked until 6 tokens exist
        elif i % 6 == 3:
            request.stop_token_sequences = [run.output_ids[4:6]]
    return out


def _staggered(engine: LLMEngine, requests: list[Request], arrivals: list[int]):
    outputs, finals, ids, step = {}, {}, {}, 0
    while len(finals) < len(requests):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(requests[i])] = i
        for response in engine.step():
            i = ids[response.request_id]
            outputs.setdefault(i, []).extend(response.output_token_ids)
            if response.is_final:
                finals[i] = response
        step += 1
        assert step < 5000
    return [(outputs[i], finals[i].finish_reason) for i in range(len(requests))], finals


@pytest.mark.parametrize("mode", ["ngram", "draft_model_self", "draft_model_other"])
def test_greedy_tokens_are_identical_with_and_without_speculation(tiny_engines, tmp_path, mode):
    target = tiny_engines("llama_gqa")
    if mode == "ngram":
        options = dict(mode="ngram", num_draft_tokens=4, prompt_lookup_min=1)
    else:  # the target as its own draft (every greedy draft right), or another model
        draft = target if mode == "draft_model_self" else tiny_engines("mistral")
        options = dict(mode="draft_model", num_draft_tokens=3, draft_engine=str(draft))
    engine_dir = speculative_engine(target, tmp_path, mode, **options)
    requests = _mixed_requests(engine_dir, 36, seed=3)
    arrivals = [random.Random(i).randint(0, 25) for i in range(len(requests))]
    with_drafts = LLMEngine(engine_dir, kv_cache_num_blocks=256)
    got, finals = _staggered(with_drafts, requests, arrivals)
    expected, _ = _staggered(LLMEngine(engine_dir, kv_cache_num_blocks=256,
                                       enable_speculative_decoding=False), requests, arrivals)
    for i, request in enumerate(requests):
        if request.sampling.greedy:
            assert got[i] == expected[i], f"request {i}"
        assert got[i][1] != FinishReason.ERROR
    stats = with_drafts.get_stats()
    assert stats["spec_num_draft_tokens"] > 50
    plain = [i for i, r in enumerate(requests) if i % 6 > 2]  # greedy without masks/penalties
    if mode == "draft_model_self":  # a greedy draft of the target itself is always right
        assert all(finals[i].num_accepted_draft_tokens == finals[i].num_draft_tokens > 0
                   for i in plain)
    if mode != "draft_model_other":  # two unrelated random models never agree
        assert 0 < stats["spec_acceptance_rate"] < 1.0
    assert {r for _, r in expected} == {FinishReason.STOP_WORDS, FinishReason.LENGTH,
                                        FinishReason.END_ID}
    bm = with_drafts.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not with_drafts.sequences


def test_speculation_pauses_in_big_batches(tiny_engines, tmp_path):
    engine_dir = speculative_engine(tiny_engines("llama_gqa"), tmp_path, mode="ngram",
                                    prompt_lookup_min=1)
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=256)
    engine.speculator.config.disable_by_batch_size = 2
    prompt = [5, 6, 7, 8] * 6
    generate(engine, [Request(prompt, 20, ignore_eos=True) for _ in range(3)])
    stats = engine.get_stats()
    assert stats["spec_num_paused_steps"] > 0
    generate(engine, [Request(prompt, 20, ignore_eos=True)])
    assert engine.get_stats()["spec_num_verify_steps"] > stats["spec_num_verify_steps"]


def test_sampling_with_drafts_keeps_the_target_distribution(tiny_engines, tmp_path):
    """Two fixed drafts, proposed for every decode of a top-4 sampled request: the tokens after
    them follow the target's own distribution, computed exactly from prefill logits."""
    from triton_backend.engine.offline import prefill_logits
    from triton_backend.engine.speculative.speculator import Speculator

    engine_dir = tiny_engines("llama_gqa")
    prompt = [random.Random(5).randrange(3, 380) for _ in range(12)]

    def target(context):  # the target's top-4 distribution after `context`
        row = prefill_logits(engine_dir, context)[-1]
        _, candidates = Sampler().target_logits(row, _chunk([], sampling), frozenset())
        return torch.softmax(candidates, dim=-1)

    sampling = SamplingParams(temperature=1.0, top_k=4)
    first = int(target(prompt).argmax())
    draft1 = int(target(prompt + [first]).topk(2).indices[1])   # often wrong
    draft2 = int(target(prompt + [first, draft1]).argmax())     # often right

    class FixedDrafts:
        def propose(self, seqs, max_drafts):
            for seq in seqs:
                seq.draft_token_ids = [draft1, draft2][:max_drafts[seq.seq_id]]

        def release(self, seq_id):
            pass

    engine = LLMEngine(engine_dir, kv_cache_num_blocks=256)
    engine.speculator = Speculator(SpeculativeConfig(mode="ngram", disable_by_batch_size=64),
                                   FixedDrafts())
    requests = [Request(prompt, 4, SamplingParams(temperature=1.0, top_k=4, seed=s),
                        ignore_eos=True) for s in range(2400)]
    outputs = [r.output_ids for r in generate(engine, requests)]
    second = [o[1] for o in outputs if o[0] == first]
    third = [o[2] for o in outputs if o[:2] == [first, draft1]]
    for context, tokens in ((prompt + [first], second), (prompt + [first, draft1], third)):
        counts = {t: tokens.count(t) for t in set(tokens)}
        stat, dof = _chi_square(counts, target(context))
        assert stat < CHI2_999[dof], (counts, stat)
    assert len(third) > 100
    stats = engine.get_stats()
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95


def test_verify_steps_and_prefills_after_a_cached_prefix_take_the_one_call_decode_path(
        tiny_engines, tmp_path):
    """Verify steps (a decode's token plus its drafts) and the short prefill left after a cached
    prefix are causal multi-row queries of one sequence: the C++ decode path runs them in one
    call, and the tokens equal the Python model's without drafts or cache (fp32)."""
    engine_dir = speculative_engine(tiny_engines("llama_gqa"), tmp_path, mode="ngram",
                                    num_draft_tokens=4, prompt_lookup_min=1)
    rng = random.Random(7)
    shared = [rng.randrange(3, 380) for _ in range(3)] * 11                 # 33 shared tokens
    prompts = [shared + [rng.randrange(3, 380) for _ in range(rng.randint(1, 6))]
               for _ in range(6)]
    requests = lambda: [Request(p, 20 + i, streaming=bool(i % 2), ignore_eos=True)  # noqa: E731
                        for i, p in enumerate(prompts)]
    fast_engine = LLMEngine(engine_dir, kv_cache_num_blocks=128)
    fast, run = fast_engine.runner.ops.decode_forward, fast_engine.runner.run
    assert fast is not None and fast.supported
    kinds = []  # per step run in one call: (has a verify chunk, has a prefill after a hit)

    def recording_run(output, *args, **kwargs):
        covers = fast.covers
        fast.covers = lambda meta, rows: covers(meta, rows) and not kinds.append((
            any(c.num_draft_tokens for c in output.chunks),
            any(c.num_computed_tokens > 0 and c.num_computed_tokens < c.num_prompt_tokens
                and len(c.new_token_ids) > 1 for c in output.chunks)))
        try:
            return run(output, *args, **kwargs)
        finally:
            fast.covers = covers
    fast_engine.runner.run = recording_run
    first = [r.output_ids for r in generate(fast_engine, requests()[:1])]
    got = first + [r.output_ids for r in generate(fast_engine, requests()[1:])]

    reference = LLMEngine(engine_dir, kv_cache_num_blocks=128, enable_prefix_caching=False,
                          enable_speculative_decoding=False)
    reference.runner.ops.decode_forward = None
    expected = [r.output_ids for r in generate(reference, requests())]
    assert got == expected
    assert any(verify for verify, _ in kinds), "no verify step ran in one call"
    assert any(after_hit for _, after_hit in kinds), "no prefill after a cached prefix did"
    stats = fast_engine.get_stats()
    assert stats["prefix_cache_hit_tokens"] >= 5 * 32 and stats["spec_num_accepted_tokens"] > 0

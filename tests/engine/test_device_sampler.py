"""The GPU backend's device sampler, run here on the CPU: the host sampler's picks for greedy
rows (min_tokens masks, NaN and infinite logits, log probs and top log probs included), draws
distributed as the host's target distribution (temperature, top-k, top-p), seeded draws that do
not depend on the batch, and a row with nothing left failing alone."""
import pytest
import torch

from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.gpu.sampling import DeviceSampler, uniform_noise
from triton_backend.engine.sampler import Sampler, SamplingError, _top_k_top_p
from triton_backend.engine.scheduler import ScheduledChunk

VOCAB = 50


def _chunk(seq_id: int, sampling=SamplingParams(), generated: int = 3, top: int = 0,
           eos=(), **request) -> ScheduledChunk:
    prompt = [1, 2, 3, 4]
    tokens = prompt + [5] * generated
    return ScheduledChunk(seq_id=seq_id, new_token_ids=[5], num_computed_tokens=len(tokens) - 1,
                          block_table=[0], needs_sample=True,
                          request=Request(prompt, 16, sampling, top_log_probs=top, **request),
                          token_ids=tokens, num_prompt_tokens=len(prompt))


def _host(logits, chunks, eos):
    """The host path's picks and alternatives (as the model runner computes them)."""
    from triton_backend.engine.step_sampling import raw_log_probs, top_alternatives

    raw = raw_log_probs(logits, chunks)
    picks = Sampler()(logits.clone(), chunks, eos)
    sampled = {c.seq_id: p for c, p in zip(chunks, picks)}
    return sampled, top_alternatives(raw, sampled, {})


def test_greedy_rows_pick_as_the_host_sampler_does():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 7] = float("nan")
    logits[3, 11] = float("inf")
    chunks = [_chunk(1), _chunk(2, SamplingParams(min_tokens=9), top=4), _chunk(3, top=2),
              _chunk(4), _chunk(5, SamplingParams(top_k=1))]
    eos = {1: frozenset(), 2: frozenset({int(logits[1].argmax()), 0}), 3: frozenset(),
           4: frozenset(), 5: frozenset()}
    got = DeviceSampler()(logits, chunks, eos)
    expected = _host(logits, chunks, eos)
    assert got[0].keys() == expected[0].keys()
    for seq_id, (token, log_prob) in expected[0].items():
        assert got[0][seq_id][0] == token
        assert got[0][seq_id][1] == pytest.approx(log_prob, abs=1e-5, nan_ok=True)
    assert got[0][2][0] not in eos[2]  # the end ids masked below min_tokens
    for seq_id, [(ids, values)] in expected[1].items():
        assert got[1][seq_id][0][0] == ids
        assert got[1][seq_id][0][1] == pytest.approx(values, abs=1e-5, nan_ok=True)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7),
                                      SamplingParams(temperature=1.3, top_k=5),
                                      SamplingParams(temperature=0.9, top_p=0.6),
                                      SamplingParams(temperature=1.0, top_k=8, top_p=0.8)])
def test_draws_follow_the_host_samplers_target_distribution(sampling):
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    target = torch.softmax(_top_k_top_p(row / sampling.temperature, sampling.top_k,
                                        sampling.top_p), dim=-1)
    sampler = DeviceSampler()
    draws = 4000
    chunks = [_chunk(i, SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p, seed=i)) for i in range(draws)]
    picks = sampler(row.expand(draws, VOCAB).contiguous(), chunks,
                    {c.seq_id: frozenset() for c in chunks})[0]
    counts = torch.bincount(torch.tensor([picks[c.seq_id][0] for c in chunks]),
                            minlength=VOCAB).float()
    assert float(counts[target == 0].sum()) == 0, "a token outside top-k / top-p was drawn"
    support = target > 0
    expected = target[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)
    # The reported log prob is the token's under temperature, before top-k / top-p.
    token, log_prob = picks[0]
    assert log_prob == pytest.approx(float(torch.log_softmax(row / sampling.temperature, -1)[token]),
                                     abs=1e-5)


def test_seeded_draws_do_not_depend_on_the_batch():
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = DeviceSampler()(rows[1:2], [_chunk(7, seeded, generated=5)], {7: frozenset()})[0]
    batch = [_chunk(1, SamplingParams(temperature=0.5)), _chunk(7, seeded, generated=5),
             _chunk(9)]
    together = DeviceSampler()(rows, batch, {1: frozenset(), 7: frozenset(), 9: frozenset()})[0]
    assert together[7] == alone[7]
    later = DeviceSampler()(rows[1:2], [_chunk(7, seeded, generated=6)], {7: frozenset()})[0]
    draws = {DeviceSampler()(rows[1:2], [_chunk(7, seeded, generated=g)],
                             {7: frozenset()})[0][7][0] for g in range(40)}
    assert len(draws) > 5 and later[7][0] in draws  # the count moves the stream on


def test_noise_is_uniform_and_changes_with_seed_and_count():
    noise = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20000)
    assert 0 < float(noise.min()) and float(noise.max()) < 1
    assert abs(float(noise.mean()) - 0.5) < 0.01
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_a_row_with_nothing_left_fails_alone_by_name():
    logits = torch.randn(2, VOCAB)
    logits[1] = float("nan")
    with pytest.raises(SamplingError) as failed:
        DeviceSampler()(logits, [_chunk(1), _chunk(2, SamplingParams(temperature=0.8))],
                        {1: frozenset(), 2: frozenset()})
    assert set(failed.value.failures) == {2}
    assert "no token can be chosen" in failed.value.failures[2]


def test_it_leaves_penalties_bad_words_grammars_and_drafts_to_the_host():
    assert DeviceSampler.takes(_chunk(1, SamplingParams(temperature=0.5, top_p=0.9, seed=1)))
    assert not DeviceSampler.takes(_chunk(1, SamplingParams(presence_penalty=0.5)))
    assert not DeviceSampler.takes(_chunk(1, bad_token_sequences=[[3]]))

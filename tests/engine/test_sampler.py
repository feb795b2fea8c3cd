"""The sampler on hand-made logits: its warpers and penalties against transformers' own, the
masks (min_tokens, bad words), seeded draws that do not depend on the batch, and rows that fail
alone."""
import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.sampler import Sampler, SamplingError
from triton_backend.engine.scheduler import ScheduledChunk

VOCAB = 50
EOS = frozenset({2})


def chunk(seq_id: int, sampling: SamplingParams = SamplingParams(), prompt=(5, 6, 7),
          generated=(), **request_fields) -> ScheduledChunk:
    tokens = list(prompt) + list(generated)
    request = Request(list(prompt), 16, sampling, **request_fields)
    return ScheduledChunk(seq_id, tokens[-1:], len(tokens) - 1, [0], True, request, tokens,
                          len(prompt))


def logits(*rows_seed: int) -> torch.Tensor:
    return torch.stack([torch.randn(VOCAB, generator=torch.Generator().manual_seed(s))
                        for s in rows_seed])


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (8, 0.5), (0, 0.05)])
def test_top_k_and_top_p_keep_what_transformers_keeps(top_k, top_p):
    row = logits(1)[0]
    c = chunk(1, SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p))
    _, candidates = Sampler().target_logits(row, c, EOS)
    theirs = row[None] / 0.7
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isfinite(candidates), torch.isfinite(theirs[0]))
    assert int(torch.isfinite(candidates).sum()) >= 1


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    row = logits(2)[0]
    c = chunk(1, SamplingParams(repetition_penalty=1.3), prompt=(3, 4, 4), generated=(9, 3))
    scored, _ = Sampler().target_logits(row, c, EOS)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([c.token_ids]), row[None].clone())
    torch.testing.assert_close(scored, theirs[0])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    row = logits(3)[0]
    c = chunk(1, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(7, 8),
              generated=(9, 9, 9, 11))
    scored, _ = Sampler().target_logits(row, c, EOS)
    expected = row.clone()
    expected[9] -= 0.5 + 0.25 * 3
    expected[11] -= 0.5 + 0.25
    torch.testing.assert_close(scored, expected)  # the prompt's 7 and 8 are untouched


def test_min_tokens_masks_the_end_ids_until_reached_unless_eos_is_ignored():
    row = torch.zeros(1, VOCAB)
    row[0, 2] = 10.0  # the end id is by far the best
    early = chunk(1, SamplingParams(min_tokens=3), generated=(9,))
    reached = chunk(2, SamplingParams(min_tokens=3), generated=(9, 9, 9))
    ignoring = chunk(3, SamplingParams(min_tokens=3), generated=(9,), ignore_eos=True)
    sampler = Sampler()
    eos = {1: EOS, 2: EOS, 3: EOS}
    picks = sampler(row.repeat(3, 1), [early, reached, ignoring], eos)
    assert picks[0][0] != 2 and picks[1][0] == 2 and picks[2][0] == 2


def test_a_bad_word_is_masked_only_after_its_prefix():
    row = torch.zeros(2, VOCAB)
    row[:, 30] = 5.0
    bad = [[20, 30]]  # 30 is banned right after 20
    after_prefix = chunk(1, generated=(20,), bad_token_sequences=bad)
    elsewhere = chunk(2, generated=(21,), bad_token_sequences=bad)
    picks = Sampler()(row, [after_prefix, elsewhere], {1: EOS, 2: EOS})
    assert picks[0][0] != 30 and picks[1][0] == 30


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    params = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows: int, steps: int = 6) -> list[int]:
        sampler, out = Sampler(), []
        for step in range(steps):
            rows = logits(*(100 + step + 7 * r for r in range(batch_rows)))
            chunks = [chunk(1, params)] + [chunk(10 + r, SamplingParams(temperature=1.0))
                                           for r in range(batch_rows - 1)]
            out.append(sampler(rows, chunks, {c.seq_id: EOS for c in chunks})[0][0])
        return out

    alone = draws(1)
    assert draws(4) == alone and len(set(alone)) > 1


def test_log_probs_are_of_the_penalised_distribution_before_top_k():
    row = logits(5)
    c = chunk(1, SamplingParams(temperature=0.5, top_k=3, seed=1))
    token, log_prob = Sampler()(row, [c], {1: EOS})[0]
    expected = torch.log_softmax(row[0] / 0.5, dim=-1)[token]
    assert token in torch.topk(row[0], 3).indices.tolist()
    assert log_prob == pytest.approx(float(expected), abs=1e-5)


def test_batched_greedy_equals_one_row_at_a_time():
    rows = logits(6, 7, 8)
    chunks = [chunk(i) for i in range(3)]
    together = Sampler()(rows, chunks, {i: EOS for i in range(3)})
    alone = [Sampler()(rows[i:i + 1], [chunks[i]], {i: EOS})[0] for i in range(3)]
    assert [t for t, _ in together] == [t for t, _ in alone] == rows.argmax(-1).tolist()
    for (_, a), (_, b) in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_row_with_no_token_left_fails_alone_naming_its_sequence():
    rows = logits(9, 10)
    rows[0] = float("nan")
    with pytest.raises(SamplingError) as err:
        Sampler()(rows, [chunk(7), chunk(8)], {7: EOS, 8: EOS})
    assert set(err.value.failures) == {7}
    assert "every logit is masked" in err.value.failures[7]


def test_infinite_logits_are_made_finite_before_a_draw():
    rows = logits(11)
    rows[0, 4] = float("inf")
    rows[0, 5] = float("nan")
    token, log_prob = Sampler()(rows, [chunk(1, SamplingParams(temperature=1.0, seed=3))],
                                {1: EOS})[0]
    assert token == 4 and log_prob == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("scale,top_p", [(3.0, 0.9), (0.3, 0.95), (8.0, 0.5), (1.0, 0.999)])
def test_top_p_over_a_wide_vocabulary_keeps_the_nucleus_a_full_sort_gives(scale, top_p):
    """Gemma's 262,144 logits: the nucleus from the best thousand or the histogram cut is the
    one the definition gives (the smallest prefix of the sorted probabilities reaching top_p,
    computed here in float64), up to the tokens a float32 sum may put on either side of its
    boundary: those whose mass before them is within the summation's error bound of top_p
    (n terms of at most 1 in all: n * 2**-24; the order of the sum, and so where inside the
    bound it lands, changes with the CPU's vector width)."""
    from triton_backend.engine.sampler import _top_k_top_p

    row = torch.randn(262_144, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    probs = torch.softmax(row.double(), dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    expected = set(order[before < top_p].tolist())
    bound = 2 * len(expected) * 2.0 ** -24 + 2.0 ** -24
    surely_in = set(order[before < top_p - bound].tolist())
    maybe_in = set(order[before < top_p + bound].tolist())
    kept = set(torch.nonzero(torch.isfinite(_top_k_top_p(row, 0, top_p))).squeeze(1).tolist())
    assert surely_in <= kept <= maybe_in, (len(kept), len(expected), len(maybe_in - surely_in))
    assert len(maybe_in - surely_in) <= len(expected) // 4  # the bound leaves a test
    assert len(expected) > 1

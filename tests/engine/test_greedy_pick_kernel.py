"""The C++ greedy pick (sampling.cpp) against torch's argmax and log-sum-exp, and the sampler
taking it: the same tokens (ties to the first maximum), log probs to float32 rounding, masked
ids never chosen, and rows with NaN or +inf sent to the guarded path."""
import math

import pytest
import torch

from triton_backend.engine.cpu.kernels import load_cpu_kernels, ops

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels did not build")


def _reference(logits: torch.Tensor, rows: list[int], ids: list[int]):
    batch = logits.clone()
    batch[rows, ids] = float("-inf")
    tokens = batch.argmax(dim=-1)
    log_probs = torch.log_softmax(batch.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, log_probs


@pytest.mark.parametrize("vocab", [49152, 1003, 7])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_matches_torch(vocab, rows):
    generator = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    tokens, log_probs = ops().greedy_pick(logits, [], [])
    want_tokens, want_log_probs = _reference(logits, [], [])
    assert tokens.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(log_probs.double(), want_log_probs, rtol=1e-6, atol=1e-6)


def test_masked_ids_are_never_chosen_and_leave_the_sum():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    logits[0, 17] = 50.0  # the maximum by far, then masked
    logits[2, 5] = 40.0
    rows, ids = [0, 0, 2, 0], [17, 3, 5, 17]  # a repeated pair counts once
    tokens, log_probs = ops().greedy_pick(logits, rows, ids)
    want_tokens, want_log_probs = _reference(logits, rows, ids)
    assert torch.equal(tokens, want_tokens)
    assert tokens[0] != 17 and tokens[2] != 5 and tokens[1] == logits[1].argmax()
    torch.testing.assert_close(log_probs.double(), want_log_probs, rtol=1e-6, atol=1e-6)
    assert logits[0, 17] == 50.0  # the caller's logits are not written


def test_ties_go_to_the_first_maximum():
    logits = torch.zeros(2, 64)
    logits[0, [9, 40, 63]] = 3.0
    logits[1, [2, 60]] = 3.0
    tokens, log_probs = ops().greedy_pick(logits, [1], [2])
    assert tokens.tolist() == [9, 60]
    want = -math.log(3 + 61 * math.exp(-3.0))
    assert log_probs[0].item() == pytest.approx(want, rel=1e-6)


def test_rows_with_nan_inf_or_nothing_left_get_a_nan_log_prob():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    logits[0, 50] = float("nan")
    logits[1, 99] = float("inf")
    logits[3, :] = float("-inf")
    _, log_probs = ops().greedy_pick(logits, [2] * 100, list(range(100)))
    assert all(math.isnan(v) for v in log_probs.tolist())


def test_bad_arguments_are_named():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops().greedy_pick(torch.zeros(2, 8, dtype=torch.bfloat16), [], [])
    with pytest.raises(RuntimeError, match="same length"):
        ops().greedy_pick(torch.zeros(2, 8), [0], [])
    with pytest.raises(RuntimeError, match="masked row 2 outside"):
        ops().greedy_pick(torch.zeros(2, 8), [2], [0])
    with pytest.raises(RuntimeError, match="masked id 8 outside the vocabulary"):
        ops().greedy_pick(torch.zeros(2, 8), [1], [8])

"""Sampling on the logits' device, with one copy to the host per step.

Rows it takes (`DeviceSampler.takes`): greedy, or temperature / top-k / top-p with the request's
seed; the min_tokens mask of the end ids; log probs and top log probs. Rows of requests with
penalties, bad words, a guided-decoding grammar or draft tokens to verify go to the host sampler
(`sampler.py`, `speculative/verifier.py`), which reads their logits on the CPU.

The same rules as the host sampler: masks, then temperature, then top-k, then top-p (the
smallest prefix whose mass reaches top_p, at least the best token); the reported log prob is the
token's under temperature, before top-k / top-p; with top_log_probs both the alternatives and the
token's own log prob are the model's raw ones. NaN logits never win; a row left with no token
fails alone (`SamplingError`).

A draw is a Gumbel-max over noise hashed from (the request's seed, how many tokens it has
generated, the token id): a request with a seed draws the same tokens whatever shares its batch
and however the batch is padded, with no generator state per request on the device. Its stream
of numbers is not the host sampler's, so a seeded request samples other tokens on a GPU than on a
CPU (each reproducibly).
"""
from __future__ import annotations

import random

import torch

from triton_backend.engine.device import host_to_device
from triton_backend.engine.sampler import SamplingError, below_min_tokens
from triton_backend.engine.scheduler import ScheduledChunk

Pick = tuple[int, float]
NO_TOKEN = ("no token can be chosen: every logit is masked (bad_words, min_tokens, the guided "
            "decoding grammar) or not a number")

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = -0x61C8864680B583EB   # 0x9E3779B97F4A7C15
_MIX1 = -0x40A7B892E31B1A47     # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15     # 0x94D049BB133111EB


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 (torch shifts signed values arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, V] float32 in (0, 1) from per-row seeds and counters (int64 [n])."""
    row = _splitmix64(seeds * 0x2545F491 + counters)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _shift_right(_splitmix64(row[:, None] ^ (ids[None, :] * _GOLDEN)), 40)  # 24 bits
    return (bits.float() + 0.5) / float(1 << 24)


class DeviceSampler:
    """Per step: `takes(chunk)` says which rows it samples; `__call__` samples them."""

    def __init__(self) -> None:
        self._seeds: dict[int, int] = {}

    def release(self, seq_id: int) -> None:
        self._seeds.pop(seq_id, None)

    @staticmethod
    def takes(chunk: ScheduledChunk) -> bool:
        request = chunk.request
        return (chunk.grammar is None and not chunk.num_draft_tokens
                and not request.sampling.has_penalties and not request.bad_token_sequences)

    def _seed(self, chunk: ScheduledChunk) -> int:
        seed = self._seeds.get(chunk.seq_id)
        if seed is None:
            given = chunk.request.sampling.seed
            seed = self._seeds[chunk.seq_id] = (given if given is not None
                                                else random.getrandbits(62)) & ((1 << 62) - 1)
        return seed

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                 eos_ids: dict[int, frozenset[int]]
                 ) -> tuple[dict[int, Pick], dict[int, list[tuple[list[int], list[float]]]]]:
        """logits [n, V] (one row per chunk, on the device) -> (seq_id -> (token, log prob),
        seq_id -> [(top ids, top log probs)] for requests that asked for alternatives)."""
        device, vocab = logits.device, logits.shape[1]
        logits = logits.float()
        raw = logits
        masked_rows, masked_ids = [], []
        for row, chunk in enumerate(chunks):
            eos = eos_ids[chunk.seq_id]
            if below_min_tokens(chunk, eos):
                masked_rows.extend([row] * len(eos))
                masked_ids.extend(eos)
        logits = torch.nan_to_num(logits, nan=float("-inf"),
                                  posinf=torch.finfo(torch.float32).max)
        if masked_rows:
            logits = logits.index_put(
                (_ints(masked_rows, device), _ints(masked_ids, device)),
                torch.full((), float("-inf"), device=device))
        params = [c.request.sampling for c in chunks]
        greedy = [p.greedy for p in params]
        temperature = _to_device([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                 torch.float32, device)
        scored = logits / temperature[:, None]
        log_probs = torch.log_softmax(scored, dim=-1)
        candidates = _top_k_top_p(scored, params, greedy)
        if all(greedy):
            tokens = candidates.argmax(dim=-1)
        else:
            seeds = _ints([0 if g else self._seed(c) for g, c in zip(greedy, chunks)], device)
            counters = _ints([len(c.token_ids) - c.num_prompt_tokens for c in chunks], device)
            noise = -torch.log(-torch.log(uniform_noise(seeds, counters, vocab)))
            is_greedy = _to_device(greedy, torch.bool, device)
            tokens = torch.where(is_greedy, candidates.argmax(dim=-1),
                                 (candidates + noise).argmax(dim=-1))
        own = log_probs.gather(1, tokens[:, None])[:, 0]
        chosen_ok = torch.isfinite(candidates.gather(1, tokens[:, None])[:, 0])
        top_k = max((c.request.top_log_probs for c in chunks), default=0)
        columns = [tokens.double(), own.double(), chosen_ok.double()]
        if top_k:
            raw_log_probs = torch.log_softmax(raw, dim=-1)
            values, ids = raw_log_probs.topk(top_k, dim=-1)
            columns += [raw_log_probs.gather(1, tokens[:, None])[:, 0].double(),
                        *values.double().T, *ids.double().T]
        host = torch.stack(columns, dim=1).cpu().tolist()  # the step's one copy to the host
        return _picks(host, chunks, top_k)


def _picks(host: list[list[float]], chunks: list[ScheduledChunk], top_k: int):
    sampled, top, failures = {}, {}, {}
    for row, chunk in zip(host, chunks):
        if not row[2]:
            failures[chunk.seq_id] = NO_TOKEN
            continue
        k = chunk.request.top_log_probs
        if k:
            values, ids = row[4:4 + top_k], row[4 + top_k:4 + 2 * top_k]
            top[chunk.seq_id] = [([int(i) for i in ids[:k]], values[:k])]
            sampled[chunk.seq_id] = (int(row[0]), row[3])
        else:
            sampled[chunk.seq_id] = (int(row[0]), row[1])
    if failures:
        raise SamplingError(failures)
    return sampled, top


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(values, torch.int64, device)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`; on CUDA through pinned memory, so the copy queues behind
    the step instead of waiting for it."""
    return host_to_device(values, dtype, device)


def _top_k_top_p(scored: torch.Tensor, params, greedy: list[bool]) -> torch.Tensor:
    """The rows after each request's top-k and top-p (greedy rows untouched)."""
    top_k = [0 if g else p.top_k for g, p in zip(greedy, params)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    vocab = scored.shape[1]
    if all(k <= 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return scored
    device = scored.device
    ordered, order = scored.sort(dim=-1, descending=True)
    ks = _to_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= ks[:, None]
    # Ties with the k-th value stay in, as the host sampler's `row < kth` keeps them.
    kth = ordered.gather(1, (ks - 1)[:, None])
    drop &= ordered < kth
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    ps = _to_device(top_p, torch.float32, device)[:, None]
    drop |= (probs.cumsum(dim=-1) - probs >= ps) & (ps < 1.0)
    return scored.scatter(1, order, ordered.masked_fill(drop, float("-inf")))

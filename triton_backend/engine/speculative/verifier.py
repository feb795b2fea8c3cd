"""Verifying draft tokens against the target model's logits, in one pass over a chunk's rows.

A chunk with `k` drafts has `k + 1` logits rows: row `i` is the target's prediction after the
sequence so far plus the first `i` drafts. Every row is judged in the context it predicts from
(the sampler's masks, penalties, `min_tokens` and bad words see the drafts before it).

- Greedy requests: accept drafts while each equals the target's greedy token; then the target's
  token at the first disagreement (or after the last draft) comes for free. Output is identical
  to decoding without drafts, token for token.
- Sampled requests: the standard rejection-sampling rule for a draft proposed with certainty
  (prompt lookup and the greedy draft model propose one token, so q is a point mass): accept
  draft `d` with probability p(d); on rejection draw from p with `d` removed (the normalised
  max(0, p - q)); after `k` acceptances draw a bonus token from p. Each output token is then
  distributed exactly as p, the target's distribution after temperature, top-k and top-p.
"""
from __future__ import annotations

import dataclasses

import torch

from triton_backend.engine.sampler import Sampler
from triton_backend.engine.scheduler import ScheduledChunk

Pick = tuple[int, float]  # (token id, log prob)


def row_contexts(chunk: ScheduledChunk) -> list[ScheduledChunk]:
    """One chunk per logits row of `chunk`: the context row `i` predicts from (drafts < i)."""
    drafts = draft_tokens(chunk)
    return [dataclasses.replace(chunk, token_ids=chunk.token_ids + drafts[:i], num_draft_tokens=0)
            for i in range(len(drafts) + 1)]


def draft_tokens(chunk: ScheduledChunk) -> list[int]:
    k = chunk.num_draft_tokens
    return chunk.new_token_ids[len(chunk.new_token_ids) - k:] if k else []


def verify(sampler: Sampler, logits: torch.Tensor, chunks: list[ScheduledChunk],
           eos_ids: dict[int, frozenset[int]]) -> tuple[dict[int, Pick], dict[int, list[Pick]]]:
    """`logits` [rows, V] float32: 1 + num_draft_tokens rows per chunk, in chunk order.

    Returns (seq_id -> the next token, seq_id -> the accepted drafts before it). Rows of greedy
    requests and of chunks without drafts go through the sampler together in one call."""
    sampled: dict[int, Pick] = {}
    accepted: dict[int, list[Pick]] = {}
    batch_rows, batch_contexts, rejection = [], [], []
    row = 0
    for chunk in chunks:
        num_rows = 1 + chunk.num_draft_tokens
        if chunk.num_draft_tokens and not chunk.request.sampling.greedy:
            rejection.append((chunk, row))
        else:
            batch_rows.extend(range(row, row + num_rows))
            batch_contexts.extend(row_contexts(chunk) if chunk.num_draft_tokens else [chunk])
        row += num_rows
    if batch_rows:
        picks = sampler(logits[batch_rows], batch_contexts, eos_ids)
        i = 0
        for chunk in chunks:
            if chunk.num_draft_tokens and not chunk.request.sampling.greedy:
                continue
            num_rows = 1 + chunk.num_draft_tokens
            accepted[chunk.seq_id], sampled[chunk.seq_id] = accept_greedy(
                draft_tokens(chunk), picks[i:i + num_rows])
            i += num_rows
    for chunk, start in rejection:
        rows = logits[start:start + 1 + chunk.num_draft_tokens]
        accepted[chunk.seq_id], sampled[chunk.seq_id] = rejection_sample(
            sampler, rows, chunk, eos_ids[chunk.seq_id])
    return sampled, accepted


def accept_greedy(drafts: list[int], picks: list[Pick]) -> tuple[list[Pick], Pick]:
    """The drafts that equal the target's picks, and the target's pick after them."""
    n = 0
    while n < len(drafts) and picks[n][0] == drafts[n]:
        n += 1
    return picks[:n], picks[n]


def rejection_sample(sampler: Sampler, rows: torch.Tensor, chunk: ScheduledChunk,
                     eos: frozenset[int]) -> tuple[list[Pick], Pick]:
    """Accept each draft with the target's probability of it; replace the first rejected one
    with a draw from the rest of the target's distribution, or add a bonus draw after the last."""
    generator = sampler.generator(chunk)
    drafts = draft_tokens(chunk)
    kept: list[Pick] = []
    for i, context in enumerate(row_contexts(chunk)):
        scored, candidates = sampler.target_logits(rows[i], context, eos)
        log_probs = torch.log_softmax(scored, dim=-1)
        probs = torch.softmax(candidates, dim=-1)
        if i < len(drafts):
            draft = drafts[i]
            if float(torch.rand((), generator=generator, device=generator.device)) < float(probs[draft]):
                kept.append((draft, float(log_probs[draft])))
                continue
            probs[draft] = 0.0  # the residual max(0, p - q) for a point-mass q at the draft
        token = int(torch.multinomial(probs, 1, generator=generator))
        return kept, (token, float(log_probs[token]))
    raise AssertionError("unreachable: the last row always draws")

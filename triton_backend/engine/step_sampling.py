"""A step's logits -> its tokens: rows the device sampler takes are sampled where the logits are
(the GPU backend), the rest on the host (penalties, bad words, grammars, draft verification) from
a CPU copy of their rows only. Both give `RunnerOutput`'s dicts, merged by sequence.

A chunk carrying draft tokens samples from its last 1 + num_draft_tokens rows: the verifier
(`speculative/verifier.py`) keeps the drafts the target agrees with.
"""
from __future__ import annotations

import torch

from triton_backend.engine.guided.masks import apply_grammar_masks
from triton_backend.engine.sampler import Sampler, SamplingError
from triton_backend.engine.scheduler import ScheduledChunk
from triton_backend.engine.speculative.verifier import verify

Pick = tuple[int, float]
Top = dict[int, list[tuple[list[int], list[float]]]]


def raw_log_probs(logits: torch.Tensor, chunks: list[ScheduledChunk]
                  ) -> dict[int, tuple[int, torch.Tensor]]:
    """seq_id -> (top_log_probs, the log-softmax of its rows) for chunks that ask for
    alternatives; rows in chunk order, 1 + num_draft_tokens each."""
    raw, row = {}, 0
    for chunk in chunks:
        num_rows = 1 + chunk.num_draft_tokens
        if chunk.request.top_log_probs:
            raw[chunk.seq_id] = (chunk.request.top_log_probs,
                                 torch.log_softmax(logits[row:row + num_rows].float(), dim=-1))
        row += num_rows
    return raw


def top_alternatives(raw: dict[int, tuple[int, torch.Tensor]], sampled: dict, accepted: dict
                     ) -> Top:
    """The alternatives of every kept token; the kept tokens' own log probs become the raw ones
    (in place), so each token's log prob is the one its alternatives list shows for it."""
    top = {}
    for seq_id, (k, rows) in raw.items():
        kept = accepted.get(seq_id, [])
        tokens = [t for t, _ in kept] + [sampled[seq_id][0]]
        values, ids = rows[:len(tokens)].topk(k, dim=-1)
        top[seq_id] = list(zip(ids.tolist(), values.tolist()))
        own = [float(rows[i, t]) for i, t in enumerate(tokens)]
        if kept:
            accepted[seq_id] = [(t, lp) for t, lp in zip(tokens[:-1], own[:-1])]
        sampled[seq_id] = (tokens[-1], own[-1])
    return top


def sample_on_host(logits: torch.Tensor, chunks: list[ScheduledChunk],
                   eos_ids: dict[int, frozenset[int]], sampler: Sampler
                   ) -> tuple[dict[int, Pick], dict[int, list[Pick]], Top]:
    """(sampled, accepted drafts, alternatives) of `chunks`, whose rows `logits` holds."""
    logits = logits.cpu().float().contiguous()  # no copy when it is so already
    raw = raw_log_probs(logits, chunks)  # before any mask or penalty
    if any(c.grammar is not None for c in chunks):
        apply_grammar_masks(logits, chunks, eos_ids)
    if any(c.num_draft_tokens for c in chunks):
        sampled, accepted = verify(sampler, logits, chunks, eos_ids)
    else:
        picks = sampler(logits, chunks, eos_ids)
        sampled, accepted = {c.seq_id: p for c, p in zip(chunks, picks)}, {}
    return sampled, accepted, top_alternatives(raw, sampled, accepted)


def sample_step(logits: torch.Tensor, chunks: list[ScheduledChunk],
                eos_ids: dict[int, frozenset[int]], sampler: Sampler, device_sampler=None
                ) -> tuple[dict[int, Pick], dict[int, list[Pick]], Top]:
    """`logits`: 1 + num_draft_tokens rows per chunk, in chunk order. With a device sampler,
    the rows it takes stay on the device; a SamplingError names the failed rows of both sides."""
    if device_sampler is None:
        return sample_on_host(logits, chunks, eos_ids, sampler)
    on_device, on_host, device_rows, host_rows, row = [], [], [], [], 0
    for chunk in chunks:
        num_rows = 1 + chunk.num_draft_tokens
        if device_sampler.takes(chunk):
            on_device.append(chunk)
            device_rows.append(row)
        else:
            on_host.append(chunk)
            host_rows.extend(range(row, row + num_rows))
        row += num_rows

    def host_side():
        return sample_on_host(_rows(logits, host_rows), on_host, eos_ids, sampler)

    def device_side():
        picks, alternatives = device_sampler(_rows(logits, device_rows), on_device, eos_ids)
        return picks, {}, alternatives

    sampled: dict[int, Pick] = {}
    accepted: dict[int, list[Pick]] = {}
    top: Top = {}
    failures: dict[int, str] = {}
    for side, run in ((on_host, host_side), (on_device, device_side)):
        if not side:
            continue
        try:
            side_sampled, side_accepted, side_top = run()
        except SamplingError as exc:
            failures.update(exc.failures)
            continue
        sampled.update(side_sampled)
        accepted.update(side_accepted)
        top.update(side_top)
    if failures:
        raise SamplingError(failures)
    return sampled, accepted, top


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]

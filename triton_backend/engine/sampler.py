"""Choosing each sequence's next token from its logits.

Order of operations (as TensorRT-LLM and transformers apply them): the guided decoding grammar's
mask (applied to the logits before they reach the sampler, `guided/masks.py`), bad words and
min_tokens masks,
repetition / presence / frequency penalties, temperature, top-k, top-p, then greedy argmax or a
draw from the request's own generator (seeded per request, so a request samples the same tokens
whatever else shares its batch).

Logits are made finite before a token is drawn (NaN -> -inf, +inf -> the largest float), so a
faulty row can never reach `multinomial`. A row with no token left to choose fails alone: the
sampler raises `SamplingError` naming those sequences, and the engine ends only them.
"""
from __future__ import annotations

import math
import random

import torch

from triton_backend.engine.scheduler import ScheduledChunk


class SamplingError(RuntimeError):
    """Some rows had no token to choose; `failures` maps their seq_id -> the reason."""

    def __init__(self, failures: dict[int, str]) -> None:
        super().__init__("; ".join(f"sequence {k}: {v}" for k, v in failures.items()))
        self.failures = failures


class Sampler:
    def __init__(self, greedy_pick=None) -> None:
        """`greedy_pick`: the backend's kernel for greedy picks of host rows (logits float32
        [n, V], masked rows, masked ids) -> (ids, log probs); None: torch's argmax."""
        self._generators: dict[int, torch.Generator] = {}
        self._greedy_pick = greedy_pick

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                 eos_ids: dict[int, frozenset[int]]) -> list[tuple[int, float]]:
        """logits [n, V] float32, one row per chunk -> (token id, log prob) per chunk."""
        results: list[tuple[int, float] | None] = [None] * len(chunks)
        plain = [i for i, chunk in enumerate(chunks) if _plain_greedy(chunk.request)]
        if plain:
            for i, pick in zip(plain, self._greedy_rows(logits, chunks, plain, eos_ids)):
                results[i] = pick
        failures: dict[int, str] = {}
        for i, chunk in enumerate(chunks):
            # A greedy pick with a non-finite log prob saw NaN/inf logits: redo it guarded.
            if results[i] is None or not math.isfinite(results[i][1]):
                try:
                    results[i] = self._one_row(logits[i], chunk, eos_ids[chunk.seq_id])
                except _NoToken as exc:
                    failures[chunk.seq_id] = str(exc)
        if failures:
            raise SamplingError(failures)
        return results

    def _greedy_rows(self, logits: torch.Tensor, chunks: list[ScheduledChunk], rows: list[int],
                     eos_ids: dict[int, frozenset[int]]) -> list[tuple[int, float]]:
        """Greedy picks of several rows in one pass (the min_tokens EOS mask included)."""
        batch = logits if len(rows) == len(chunks) else logits[rows]
        masked_rows, masked_ids = [], []
        for r, i in enumerate(rows):
            eos = eos_ids[chunks[i].seq_id]
            if below_min_tokens(chunks[i], eos):
                masked_rows.extend([r] * len(eos))
                masked_ids.extend(eos)
        if batch.device.type == "cpu" and self._greedy_pick is not None:  # two passes a row
            tokens, log_probs = self._greedy_pick(batch.float().contiguous(), masked_rows,
                                                  masked_ids)
            return list(zip(tokens.tolist(), log_probs.tolist()))
        if masked_rows:
            batch = batch.clone()
            batch[masked_rows, masked_ids] = float("-inf")
        tokens = batch.argmax(dim=-1)
        log_probs = batch.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(batch, dim=-1)
        return list(zip(tokens.tolist(), log_probs.tolist()))

    def _one_row(self, row: torch.Tensor, chunk: ScheduledChunk, eos: frozenset[int]
                 ) -> tuple[int, float]:
        scored, candidates = self.target_logits(row, chunk, eos)
        log_probs = torch.log_softmax(scored, dim=-1)
        if chunk.request.sampling.greedy:
            token = int(torch.argmax(candidates))
        else:
            token = self._draw(candidates, chunk)
        return token, float(log_probs[token])

    def target_logits(self, row: torch.Tensor, chunk: ScheduledChunk, eos: frozenset[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's target distribution at `row`: (logits after masks, penalties and
        temperature, made finite, whose log-softmax is the reported log prob; the same after
        top-k / top-p, which a draw samples from). Speculative verification samples from the
        same. Raises _NoToken when no token is left to choose."""
        row = self._mask(row.clone(), chunk, eos)
        params = chunk.request.sampling
        if params.has_penalties:
            row = _apply_penalties(row, chunk)
        if not params.greedy:
            row = row / params.temperature
        row = _finite(row)
        if params.greedy:
            return row, row
        return row, _top_k_top_p(row, params.top_k, params.top_p)

    def generator(self, chunk: ScheduledChunk) -> torch.Generator:
        """The request's own generator (seeded by the request, else at random), made once."""
        generator = self._generators.get(chunk.seq_id)
        if generator is None:
            seed = chunk.request.sampling.seed
            generator = torch.Generator(device="cpu").manual_seed(seed if seed is not None
                                                      else random.getrandbits(63))
            self._generators[chunk.seq_id] = generator
        return generator

    def _mask(self, row: torch.Tensor, chunk: ScheduledChunk, eos: frozenset[int]) -> torch.Tensor:
        request = chunk.request
        if below_min_tokens(chunk, eos):
            row[list(eos)] = float("-inf")
        for bad in request.bad_token_sequences:
            prefix = bad[:-1]
            if not prefix or chunk.token_ids[len(chunk.token_ids) - len(prefix):] == prefix:
                row[bad[-1]] = float("-inf")
        return row

    def _draw(self, row: torch.Tensor, chunk: ScheduledChunk) -> int:
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator(chunk)))


class _NoToken(ValueError):
    """Every logit of a row is masked or was NaN."""


def _finite(row: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest float; -inf (masked) stays."""
    row = torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
    if not bool(torch.isfinite(row).any()):
        raise _NoToken("no token can be chosen: every logit is masked (bad_words, min_tokens, "
                       "the guided decoding grammar) or not a number")
    return row


def _plain_greedy(request) -> bool:
    """Greedy with nothing but the EOS mask: such rows are picked together in one pass."""
    return (request.sampling.greedy and not request.sampling.has_penalties
            and not request.bad_token_sequences)


def below_min_tokens(chunk: ScheduledChunk, eos: frozenset[int]) -> bool:
    generated = len(chunk.token_ids) - chunk.num_prompt_tokens
    return bool(eos) and not chunk.request.ignore_eos and generated < chunk.request.sampling.min_tokens


def _apply_penalties(row: torch.Tensor, chunk: ScheduledChunk) -> torch.Tensor:
    params = chunk.request.sampling
    if params.repetition_penalty != 1.0:
        # As transformers: over prompt and output; divide positive logits, multiply negative ones.
        seen = torch.tensor(sorted(set(chunk.token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                values * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        generated = chunk.token_ids[chunk.num_prompt_tokens:]
        if generated:
            ids, counts = torch.tensor(generated, dtype=torch.long,
                                       device=row.device).unique(return_counts=True)
            row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
    return row


# Top-p reads the most likely tokens in order; with a wide vocabulary (Gemma's 262,144) sorting
# every logit cost ~60-120 ms a row on a 2-vCPU Xeon. The nucleus usually lies among the best
# thousand tokens, so those are taken first (topk is linear in the vocabulary); where their mass
# falls short, one weighted histogram of the logits finds a cut whose tokens hold top_p, and only
# the tokens above it are sorted.
NUCLEUS_CANDIDATES = 1024
NUCLEUS_BINS = 4096


def _top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    cuts_top_k = 0 < top_k < row.numel()
    if cuts_top_k:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p >= 1.0:
        return row
    probs = torch.softmax(row, dim=-1)
    if cuts_top_k:  # the top-k (and its ties) are the candidates
        candidates = torch.nonzero(row > float("-inf")).squeeze(1)
    else:
        candidates = torch.topk(row, min(NUCLEUS_CANDIDATES, row.numel())).indices
        if float(probs[candidates].sum()) < top_p:
            candidates = _nucleus_cut(row, probs, top_p)
    values, order = torch.sort(row[candidates], descending=True)
    order = candidates[order]
    kept = probs[order]
    # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
    keep = (kept.cumsum(dim=-1) - kept) < top_p
    out = torch.full_like(row, float("-inf"))
    out[order[keep]] = values[keep]
    return out


def _nucleus_cut(row: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens whose logit is at least a cut holding top_p of the mass: every token of the
    nucleus and a few more. One pass: the mass per bin of the logits (a histogram weighted by
    the probabilities), summed from the top; the cut is one bin below the bin that reaches
    top_p, so rounding in the sums never leaves a nucleus token out."""
    finite = torch.isfinite(row)
    logits = row[finite]
    low, high = float(logits.min()), float(logits.max())
    if high <= low:
        return torch.nonzero(finite).squeeze(1)
    mass, edges = torch.histogram(logits, bins=NUCLEUS_BINS, range=(low, high),
                                  weight=probs[finite])
    reached = torch.nonzero(mass.flip(0).cumsum(0) >= top_p)
    top_bin = NUCLEUS_BINS - 1 - (int(reached[0]) if reached.numel() else NUCLEUS_BINS - 1)
    cut = float(edges[max(0, top_bin - 1)])
    return torch.nonzero(row >= cut).squeeze(1)

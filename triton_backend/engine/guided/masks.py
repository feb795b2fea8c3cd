"""Applying the grammar masks of a step's sampling rows to their logits.

A chunk owns `1 + num_draft_tokens` consecutive rows (the verifier's layout). Its grammar says
which tokens each row may take; a disallowed token's logit becomes -inf before the sampler sees
the row, so greedy picks, draws, speculative acceptance and the reported log probs all follow the
grammar. The grammar's end (the engine's end ids) is translated to the request's own end ids.
"""
from __future__ import annotations

import numpy as np
import torch

from triton_backend.engine.scheduler import ScheduledChunk


def apply_grammar_masks(logits: torch.Tensor, chunks: list[ScheduledChunk],
                        eos_ids: dict[int, frozenset[int]]) -> None:
    """Mask `logits` [rows, V] in place; rows in chunk order, 1 + num_draft_tokens each."""
    rows, spans = [], []
    row = 0
    for chunk in chunks:
        num_rows = 1 + chunk.num_draft_tokens
        if chunk.grammar is not None:
            spans.append((chunk, len(rows)))
            rows.extend(range(row, row + num_rows))
        row += num_rows
    if not spans:
        return
    vocab = logits.shape[1]
    words = -(-spans[0][0].grammar.mask_vocab_size // 32)
    mask = np.zeros((len(rows), words), dtype=np.int32)
    for chunk, first in spans:
        end_ids = eos_ids[chunk.seq_id]
        chunk.grammar.sync(chunk.token_ids[chunk.num_prompt_tokens:], end_ids)
        chunk.grammar.fill_rows(mask, first, _drafts(chunk))
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for chunk, first in spans:
        _translate_end_ids(allowed[first:first + 1 + chunk.num_draft_tokens],
                           chunk.grammar.engine_eos_ids, eos_ids[chunk.seq_id], vocab)
    index = torch.tensor(rows, dtype=torch.long)
    logits[index] = logits[index].masked_fill(~torch.from_numpy(allowed), float("-inf"))


def _drafts(chunk: ScheduledChunk) -> list[int]:
    k = chunk.num_draft_tokens
    return chunk.new_token_ids[len(chunk.new_token_ids) - k:] if k else []


def _translate_end_ids(allowed: np.ndarray, grammar_end: frozenset[int],
                       request_end: frozenset[int], vocab: int) -> None:
    """Where the grammar may end, the request's end ids are allowed (and only those)."""
    grammar_end = [t for t in grammar_end if t < vocab]
    request_end = [t for t in request_end if t < vocab]
    may_end = allowed[:, grammar_end].any(axis=1) if grammar_end else np.zeros(len(allowed), bool)
    if grammar_end:
        allowed[:, grammar_end] = False
    if request_end:
        allowed[np.ix_(may_end, request_end)] = True

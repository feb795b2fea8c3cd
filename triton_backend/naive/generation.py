"""One `transformers` generate call for an llm-forge `Request`: its settings, streamer and hooks.

Kept apart from the executor so the mapping (Request fields -> generate arguments) is testable.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from triton_backend.engine.request import FinishReason, Request


def generation_config(request: Request, eos_ids: list[int], pad_id: int | None) -> GenerationConfig:
    """A fresh GenerationConfig (the checkpoint's generation_config.json must not leak in: it may
    ask for sampling or a different length)."""
    s = request.sampling
    sample = not s.greedy
    return GenerationConfig(
        max_new_tokens=request.max_tokens,
        min_new_tokens=s.min_tokens if s.min_tokens and eos_ids else None,
        do_sample=sample,
        # Greedy leaves the sampling knobs unset: transformers warns about any it would ignore.
        temperature=s.temperature if sample else None,
        top_k=s.top_k if sample else None,
        top_p=s.top_p if sample else None,
        repetition_penalty=s.repetition_penalty,
        bad_words_ids=[list(w) for w in request.bad_token_sequences] or None,
        eos_token_id=list(eos_ids) or None,
        pad_token_id=pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0),
        num_beams=1,
    )


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI-style penalties over the generated tokens (transformers has no built-in one)."""

    def __init__(self, presence: float, frequency: float, num_prompt_tokens: int) -> None:
        self.presence, self.frequency, self.start = presence, frequency, num_prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.start:]
        if generated.numel() == 0:
            return scores
        counts = torch.bincount(generated, minlength=scores.shape[-1]).to(scores.dtype)
        scores[0] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


class LogProbRecorder(LogitsProcessor):
    """Keeps the last step's log-probabilities (of the processed scores) for the streamer."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.last = torch.log_softmax(scores[0].float(), dim=-1)
        return scores


class StopOnSequences(StoppingCriteria):
    """Stops after a stop sequence (kept in the output, as the torch runtime does) or on cancel."""

    def __init__(self, stops: list[list[int]], num_prompt_tokens: int, min_tokens: int,
                 cancelled: threading.Event) -> None:
        self.stops, self.start, self.min_tokens = stops, num_prompt_tokens, min_tokens
        self.cancelled = cancelled
        self.matched = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = self.cancelled.is_set()
        generated = input_ids[0, self.start:].tolist()
        if not done and len(generated) >= self.min_tokens:
            self.matched = any(len(generated) >= len(s) and generated[-len(s):] == s
                               for s in self.stops)
            done = self.matched
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


@dataclass
class TokenStreamer(BaseStreamer):
    """Receives each new token from generate (the first `put` is the prompt and is skipped)."""

    on_token: Callable[[int, float], None]
    log_probs: LogProbRecorder
    _seen_prompt: bool = False
    tokens: list[int] = field(default_factory=list)

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        token = int(value.reshape(-1)[0])
        last = self.log_probs.last
        log_prob = float(last[token]) if last is not None else 0.0
        self.tokens.append(token)
        self.on_token(token, log_prob)

    def end(self) -> None:
        pass


def finish_reason(tokens: list[int], request: Request, eos_ids: list[int], stopped: bool,
                  cancelled: bool) -> FinishReason:
    if cancelled:
        return FinishReason.CANCELLED
    if stopped:
        return FinishReason.STOP_WORDS
    if tokens and eos_ids and tokens[-1] in eos_ids and len(tokens) >= request.sampling.min_tokens:
        return FinishReason.END_ID
    return FinishReason.LENGTH

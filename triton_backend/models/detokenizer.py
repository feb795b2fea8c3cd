"""Incremental detokenization that needs no state between chunks.

A streamed chunk's text is `visible(preceding + new) - visible(preceding)`, where `preceding`
is a window of the tokens already streamed and `visible` is the decoded text minus what may still
change:
- a trailing U+FFFD: the bytes of a multi-byte character that has not been completed yet;
- a trailing piece of text that is the beginning of a stop string (it may turn out to be one).
The final chunk hides nothing, except that a stop string ending the text is trimmed.

Why this is exact: decoding more tokens only appends to the text of the preceding ones (we
decode without clean-up of tokenization spaces), and what `visible` hides is always a suffix that
a longer text either hides too or shows, so `visible(preceding)` is a prefix of
`visible(preceding + new)` and the chunks concatenate to the non-streamed text. Decoding the
window instead of the whole sequence keeps each chunk O(window); the window only has to reach
back past the hidden suffix, which `PRECEDING_WINDOW` tokens do for stop strings of up to that
many tokens.
"""
from __future__ import annotations

from typing import Protocol, Sequence

PRECEDING_WINDOW = 64
REPLACEMENT_CHAR = "\ufffd"
STOP_WORDS_REASON = "stop_words"


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], **kwargs) -> str: ...


def decode(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def stop_strings_of(tokenizer: Tokenizer, stop_words: Sequence[Sequence[int]],
                    skip_special_tokens: bool = True) -> list[str]:
    """The text of each stop token sequence: what the executor matched, as it ends the text."""
    return [text for text in (decode(tokenizer, ids, skip_special_tokens) for ids in stop_words)
            if text]


def _stop_prefix_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def visible_text(text: str, final: bool, stop_strings: Sequence[str] = (),
                 finish_reason: str = "") -> str:
    """The part of `text` that no later token can change (all of it when `final`)."""
    if final:
        if finish_reason == STOP_WORDS_REASON:
            for stop in sorted((s for s in stop_strings if s), key=len, reverse=True):
                if text.endswith(stop):
                    return text[:-len(stop)]
        return text
    text = text.rstrip(REPLACEMENT_CHAR)
    return text[:len(text) - _stop_prefix_length(text, stop_strings)]


def text_delta(tokenizer: Tokenizer, preceding_ids: Sequence[int], new_ids: Sequence[int],
               finish_reason: str = "", stop_strings: Sequence[str] = (),
               skip_special_tokens: bool = True) -> str:
    """Text to stream for `new_ids`, given (a window of) the ids streamed before them.

    `finish_reason` empty means more chunks follow; otherwise this is the final chunk.
    """
    preceding_ids = list(preceding_ids)[-PRECEDING_WINDOW:]
    final = bool(finish_reason)
    before = ""
    if preceding_ids:
        before = visible_text(decode(tokenizer, preceding_ids, skip_special_tokens), False,
                              stop_strings)
    after = visible_text(decode(tokenizer, preceding_ids + list(new_ids), skip_special_tokens),
                         final, stop_strings, finish_reason)
    # `before` is a prefix of `after` (module docstring); a shorter `after` only happens when a
    # final stop-string trim reaches into text already streamed, which cannot be taken back.
    return after[len(before):]


class IncrementalDetokenizer:
    """Stateful wrapper for one stream (used by the BLS model, which sees every chunk)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._stop_strings = list(stop_strings)
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []

    def add(self, new_ids: Sequence[int], finish_reason: str = "") -> str:
        delta = text_delta(self._tokenizer, self._ids[-PRECEDING_WINDOW:], new_ids,
                           finish_reason, self._stop_strings, self._skip_special_tokens)
        self._ids.extend(int(i) for i in new_ids)
        return delta

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

"""TensorRT-LLM's [2, L] word-list format for `stop_words_list` / `bad_words_list`.

Row 0 holds the token ids of all words back to back; row 1 holds each word's end offset into
row 0, padded with -1 to length L. Example: words [[5, 6], [7]] -> [[5, 6, 7], [2, 3, -1]].
A batch of requests adds a leading batch dimension: [B, 2, L].
"""
from __future__ import annotations

import numpy as np


def to_word_list(words: list[list[int]]) -> np.ndarray:
    """Encode token-id words as a [2, L] int32 array; no words is [[0], [-1]] (one empty slot)."""
    ids = [token for word in words for token in word]
    offsets = np.cumsum([len(word) for word in words]).tolist()
    length = max(len(ids), len(offsets), 1)
    array = np.zeros((2, length), dtype=np.int32)
    array[0, :len(ids)] = ids
    array[1, :] = -1
    array[1, :len(offsets)] = offsets
    return array


def from_word_list(array: np.ndarray, field: str) -> list[list[int]]:
    """Decode a [2, L] (or [1, 2, L]) word list; ValueError naming `field` when malformed."""
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] != 2:
        raise ValueError(f"{field} must have shape [2, L] (ids row, offsets row), "
                         f"got {list(array.shape)}")
    if array.dtype.kind not in "iu":  # whole-number floats pass; anything else is refused
        if array.dtype.kind != "f" or not np.isfinite(array).all() \
                or not (array == np.round(array)).all():
            raise ValueError(f"{field} must hold integer token ids and offsets, got "
                             f"{array.dtype} values")
        array = array.astype(np.int64)
    ids, offsets = array[0].tolist(), array[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if end <= start or end > len(ids):
            raise ValueError(f"{field}: offsets must increase within 1..{len(ids)}, "
                             f"got {offsets}")
        words.append([int(token) for token in ids[start:end]])
        start = end
    return words

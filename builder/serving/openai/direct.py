"""OpenAI requests straight to the `tensorrt_llm` model, tokenized and detokenized here.

Through the `ensemble` every streamed token also costs a `postprocessing` call (a Python-backend
round trip) and the ensemble's own scheduling in tritonserver; on a small machine those share the
cores with the engine. The OpenAI endpoint already holds the engine's tokenizer, so the direct path
prepares the request with the same code as `preprocessing` and the BLS (`text_request.py`: prompt
ids, the max_input_len / max_seq_len checks, stop words as token sequences) and turns each chunk
of ids into text with the BLS's incremental detokenizer (`detokenizer.py`, stop strings trimmed).
The answers are the ensemble's, token for token and character for character.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from triton_backend.engine.config import Limits
from triton_backend.models.detokenizer import IncrementalDetokenizer, stop_strings_of
from triton_backend.models.request_converter import RequestError, check_output_len
from triton_backend.models.text_request import (encode_words, prompt_ids,
                                                tensorrt_llm_inputs)

# What the endpoint reads of each `tensorrt_llm` response (log probs only when asked for).
DIRECT_OUTPUTS = ("output_ids", "finish_reason", "num_input_tokens", "num_output_tokens")
DIRECT_LOG_PROB_OUTPUTS = ("output_log_probs",)
DIRECT_TOP_OUTPUTS = ("output_top_ids", "output_top_log_probs")


@dataclass(frozen=True)
class TextCodec:
    """The tokenizer and the settings the repository's preprocessing / postprocessing use."""

    tokenizer: object
    limits: Limits
    add_special_tokens: bool = True
    skip_special_tokens: bool = True


@dataclass
class DirectRequest:
    tensors: dict[str, np.ndarray]  # the tensorrt_llm model's inputs
    detokenizer: IncrementalDetokenizer


def direct_request(codec: TextCodec, values: dict[str, object]) -> DirectRequest:
    """The `tensorrt_llm` request for `values` (plain values by the names the BLS reads), built
    as the BLS builds its inner request; raises `RequestError` with the message the ensemble
    would give for the same input."""
    tokenizer = codec.tokenizer
    ids = prompt_ids(tokenizer, str(values["text_input"]), codec.add_special_tokens, codec.limits)
    max_tokens = check_output_len(values.get("max_tokens"), len(ids), codec.limits)
    stop = encode_words(tokenizer, list(values.get("stop_words") or []), "stop_words")
    # Always streamed inside: chunks are where a client that went away is noticed.
    tensors = tensorrt_llm_inputs(values, ids, max_tokens, stop, [], streaming=True)
    if values.get("top_log_probs"):  # the tensorrt_llm model's own input (not the ensemble's)
        tensors["top_log_probs"] = np.asarray([[values["top_log_probs"]]], dtype=np.int32)
    stop_strings = stop_strings_of(tokenizer, stop, codec.skip_special_tokens)
    return DirectRequest(tensors, IncrementalDetokenizer(tokenizer, stop_strings,
                                                         codec.skip_special_tokens))


__all__ = ["DIRECT_LOG_PROB_OUTPUTS", "DIRECT_OUTPUTS", "DIRECT_TOP_OUTPUTS", "DirectRequest", "RequestError",
           "TextCodec", "direct_request"]

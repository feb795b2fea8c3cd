"""The `postprocessing` Triton model: token ids -> text, statelessly incremental.

Each response of the tensorrt_llm model arrives with a window of the ids streamed before it
(`PRECEDING_OUTPUT_IDS`) and its finish reason, so the text of a chunk continues the text of the
previous chunks exactly (see `detokenizer`). Without those inputs (a client calling this model
directly, as with NVIDIA's) the ids are decoded as one complete sequence.
"""
from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from triton_backend.models.detokenizer import stop_strings_of, text_delta
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import RequestError
from triton_backend.models.triton_io import (error_response, limit_compute_threads, make_response,
                                              read_inputs)
from triton_backend.models.word_list import from_word_list

INPUT_NAMES = ("TOKENS_BATCH", "SEQUENCE_LENGTH", "PRECEDING_OUTPUT_IDS", "FINISH_REASON",
               "STOP_WORDS_IDS")
COMPLETE = "length"  # decode as a finished sequence when no finish reason is given


def postprocess(inputs: dict, tokenizer, skip_special_tokens: bool) -> dict:
    """The OUTPUT tensor of one request (batch 1, beam 1)."""
    tokens = np.asarray(inputs["TOKENS_BATCH"]).reshape(-1).tolist()
    length = inputs.get("SEQUENCE_LENGTH")
    if length is not None and np.asarray(length).size == 1:
        tokens = tokens[:int(np.asarray(length).reshape(-1)[0])]
    preceding = inputs.get("PRECEDING_OUTPUT_IDS")
    preceding = [] if preceding is None else np.asarray(preceding).reshape(-1).tolist()
    reason = COMPLETE
    if inputs.get("FINISH_REASON") is not None:
        raw = np.asarray(inputs["FINISH_REASON"], dtype=object).reshape(-1)[0]
        reason = raw.decode() if isinstance(raw, bytes) else str(raw)
    stop_strings = []
    if inputs.get("STOP_WORDS_IDS") is not None:
        stop_strings = stop_strings_of(tokenizer, from_word_list(inputs["STOP_WORDS_IDS"],
                                                                 "STOP_WORDS_IDS"),
                                       skip_special_tokens)
    text = text_delta(tokenizer, preceding, tokens, reason, stop_strings, skip_special_tokens)
    return {"OUTPUT": np.asarray([[text.encode("utf-8")]], dtype=object)}


class PostprocessingModel:
    def initialize(self, args):
        limit_compute_threads()
        params = ModelParams(args)
        self.tokenizer = AutoTokenizer.from_pretrained(str(params.path("tokenizer_dir")))
        self.skip_special_tokens = params.flag("skip_special_tokens", True)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = postprocess(read_inputs(request, INPUT_NAMES), self.tokenizer,
                                      self.skip_special_tokens)
                responses.append(make_response(outputs))
            except (RequestError, ValueError) as exc:
                responses.append(error_response(str(exc)))
        return responses

    def finalize(self):
        pass

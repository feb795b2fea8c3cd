"""The `preprocessing` Triton model: text -> token ids and [2, L] stop / bad word lists.

A thin adapter over `text_request`; each request is answered (or refused with an error naming
the field and the limit) on its own, so one bad request never fails its batch.
"""
from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from triton_backend.engine.config import EngineConfig
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import RequestError, check_output_len, scalar
from triton_backend.models.triton_io import (error_response, limit_compute_threads, make_response,
                                              read_inputs)
from triton_backend.models.text_request import (encode_words, prompt_ids, text_list,
                                                 text_value)
from triton_backend.models.word_list import to_word_list

INPUT_NAMES = ("QUERY", "REQUEST_OUTPUT_LEN", "BAD_WORDS_DICT", "STOP_WORDS_DICT",
               "APPLY_CHAT_TEMPLATE")


def preprocess(inputs: dict, tokenizer, limits, add_special_tokens: bool) -> dict:
    """Output tensors of one request (batch dimension 1)."""
    ids = prompt_ids(tokenizer, text_value(inputs, "QUERY", "text_input"), add_special_tokens,
                     limits, bool(scalar(inputs, "APPLY_CHAT_TEMPLATE") or False))
    max_tokens = check_output_len(scalar(inputs, "REQUEST_OUTPUT_LEN"), len(ids), limits)
    stop = encode_words(tokenizer, text_list(inputs, "STOP_WORDS_DICT", "stop_words"),
                        "stop_words")
    bad = encode_words(tokenizer, text_list(inputs, "BAD_WORDS_DICT", "bad_words"), "bad_words")
    return {
        "INPUT_ID": np.asarray([ids], dtype=np.int32),
        "REQUEST_INPUT_LEN": np.asarray([[len(ids)]], dtype=np.int32),
        "REQUEST_OUTPUT_LEN": np.asarray([[max_tokens]], dtype=np.int32),
        "STOP_WORDS_IDS": to_word_list(stop)[None],
        "BAD_WORDS_IDS": to_word_list(bad)[None],
    }


class PreprocessingModel:
    def initialize(self, args):
        limit_compute_threads()
        params = ModelParams(args)
        self.limits = EngineConfig.load(params.path("engine_dir")).limits
        self.tokenizer = AutoTokenizer.from_pretrained(str(params.path("tokenizer_dir")))
        self.add_special_tokens = params.flag("add_special_tokens", True)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = preprocess(read_inputs(request, INPUT_NAMES), self.tokenizer,
                                     self.limits, self.add_special_tokens)
                responses.append(make_response(outputs))
            except RequestError as exc:
                responses.append(error_response(str(exc)))
        return responses

    def finalize(self):
        pass

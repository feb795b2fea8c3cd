"""The `postprocessing` Triton model: token ids -> text, statelessly incremental.

Each response of the tensorrt_llm model arrives with a window of the ids streamed before it
(`PRECEDING_OUTPUT_IDS`) and its finish reason, so the text of a chunk continues the text of the
previous chunks exactly (see `detokenizer`). Without those inputs (a client calling this model
directly, as with NVIDIA's) the ids are decoded as one complete sequence.

In the ensemble this is also where a cancelled stream is noticed: Triton 2.51 marks the steps a
cancelled ensemble request starts after the cancellation, never the tensorrt_llm step that runs.
A cancelled request here stops tensorrt_llm by the request's `CANCEL_KEY` and is answered as any
other, so the ensemble goes on to tensorrt_llm's CANCELLED final response and completes.
"""
from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from triton_backend.models.detokenizer import stop_strings_of, text_delta
from triton_backend.models.model_params import ModelParams
from triton_backend.models.request_converter import RequestError
from triton_backend.models.triton_io import (error_response, limit_compute_threads, make_response,
                                              read_inputs, stop_request)
from triton_backend.models.word_list import from_word_list

INPUT_NAMES = ("TOKENS_BATCH", "SEQUENCE_LENGTH", "PRECEDING_OUTPUT_IDS", "FINISH_REASON",
               "STOP_WORDS_IDS", "CANCEL_KEY")
COMPLETE = "length"  # decode as a finished sequence when no finish reason is given
STOPPED_KEYS_KEPT = 1024  # cancel keys already stopped, so a stream's later chunks send no more


def cancel_key_of(inputs: dict) -> str:
    """The tensorrt_llm request's cancel key, "" when the ensemble did not pass one."""
    key = inputs.get("CANCEL_KEY")
    if key is None or np.asarray(key).size != 1:
        return ""
    raw = np.asarray(key, dtype=object).reshape(-1)[0]
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


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
        self.tensorrt_llm_model = params.text("tensorrt_llm_model_name", "tensorrt_llm")
        self.stopped_keys: dict[str, None] = {}  # insertion-ordered: the oldest go first

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = read_inputs(request, INPUT_NAMES)
                if request.is_cancelled():
                    self._stop(cancel_key_of(inputs))
                outputs = postprocess(inputs, self.tokenizer, self.skip_special_tokens)
                responses.append(make_response(outputs))
            except (RequestError, ValueError) as exc:
                responses.append(error_response(str(exc)))
        return responses

    def _stop(self, key: str) -> None:
        """Stop the tensorrt_llm request of a cancelled ensemble stream, once per key."""
        if not key or key in self.stopped_keys:
            return
        self.stopped_keys[key] = None
        if len(self.stopped_keys) > STOPPED_KEYS_KEPT:
            del self.stopped_keys[next(iter(self.stopped_keys))]
        try:
            stop_request(self.tensorrt_llm_model, key)
        except Exception:  # tensorrt_llm is shutting down: the drain ends the request
            pass

    def finalize(self):
        pass

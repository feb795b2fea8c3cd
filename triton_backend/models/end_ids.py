"""The end id NVIDIA's C++ `tensorrt_llm` backend needs, added to our preprocessing's outputs.

Pure numpy (tested without Triton); `trtllm_preprocessing` is the Triton model around it.
"""
from __future__ import annotations

import numpy as np

from triton_backend.models.request_converter import RequestError, scalar
from triton_backend.models.word_list import from_word_list, to_word_list

END_ID_INPUTS = ("END_ID", "PAD_ID")


def add_end_ids(outputs: dict, inputs: dict, eos_token_ids: list[int], pad_id: int) -> dict:
    """`outputs` of `preprocess` plus OUT_END_ID / OUT_PAD_ID and the extra EOS ids as stop words."""
    requested = inputs.get("END_ID")
    if requested is not None:
        end_id, extra_eos = int(scalar(inputs, "END_ID")), []
    elif eos_token_ids:
        end_id, extra_eos = eos_token_ids[0], eos_token_ids[1:]
    else:
        raise RequestError("end_id: the checkpoint names no EOS id; pass end_id with the request")
    pad = inputs.get("PAD_ID")
    pad_value = int(scalar(inputs, "PAD_ID")) if pad is not None else pad_id
    result = dict(outputs)
    if extra_eos:
        stop = from_word_list(outputs["STOP_WORDS_IDS"], "stop_words")
        result["STOP_WORDS_IDS"] = to_word_list(stop + [[t] for t in extra_eos])[None]
    result["OUT_END_ID"] = np.asarray([[end_id]], dtype=np.int32)
    result["OUT_PAD_ID"] = np.asarray([[pad_value]], dtype=np.int32)
    return result

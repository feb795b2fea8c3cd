"""Text-level request handling shared by `preprocessing` and `tensorrt_llm_bls`. Pure.

Turns the ensemble's inputs (`text_input`, `max_tokens`, `stop_words`, ...) into token ids and,
for the BLS model, into the `tensorrt_llm` model's inputs. Errors are `RequestError`s naming the
ensemble field (and the preprocessing tensor that carries it).
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import numpy as np

from triton_backend.engine.config import Limits
from triton_backend.engine.validation import MAX_WORDS, MAX_WORDS_TOKENS
from triton_backend.models.request_converter import RequestError, scalar
from triton_backend.models.word_list import to_word_list

# No tokenizer this project serves has a token longer than this many characters, so a prompt
# longer than max_input_len * MAX_CHARS_PER_TOKEN is over the limit before it is tokenized (a
# 50 MB text is refused in microseconds instead of holding a model instance for seconds).
MAX_CHARS_PER_TOKEN = 64

# Ensemble / BLS optional inputs passed straight to the tensorrt_llm model (ensemble input_map).
PASSTHROUGH_INPUTS = {
    "exclude_input_in_output": ("exclude_input_in_output", np.bool_),
    "end_id": ("end_id", np.int32), "pad_id": ("pad_id", np.int32),
    "top_k": ("runtime_top_k", np.int32), "top_p": ("runtime_top_p", np.float32),
    "temperature": ("temperature", np.float32), "length_penalty": ("len_penalty", np.float32),
    "repetition_penalty": ("repetition_penalty", np.float32),
    "min_tokens": ("min_tokens", np.int32), "presence_penalty": ("presence_penalty", np.float32),
    "frequency_penalty": ("frequency_penalty", np.float32), "seed": ("seed", np.uint64),
    "return_log_probs": ("return_log_probs", np.bool_),
    "return_perf_metrics": ("return_perf_metrics", np.bool_),
    "return_num_input_tokens": ("return_num_input_tokens", np.bool_),
    "return_num_output_tokens": ("return_num_output_tokens", np.bool_),
    "beam_width": ("beam_width", np.int32),
    "num_return_sequences": ("num_return_sequences", np.int32),
    "timeout_ms": ("timeout_ms", np.uint64), "priority": ("priority", np.int32),
    "guided_decoding_guide_type": ("guided_decoding_guide_type", np.object_),
    "guided_decoding_guide": ("guided_decoding_guide", np.object_),
    "lora_task_id": ("lora_task_id", np.uint64),
}
# NVIDIA's LoRA tensors, passed on as they came (one request: [N, W] and [N, 3]).
LORA_ARRAY_INPUTS = {"lora_weights": np.float16, "lora_config": np.int32}


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict], **kwargs): ...


def _utf8(value: object, field: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{field} is not valid UTF-8 (byte {exc.start}: "
                           f"{exc.object[exc.start:exc.start + 4]!r})") from None


def text_value(inputs: Mapping[str, np.ndarray], name: str, field: str) -> str:
    """The one string of a required string input, strictly UTF-8."""
    array = inputs.get(name)
    if array is None:
        raise RequestError(f"{field} is required")
    array = np.asarray(array, dtype=object).reshape(-1)
    if array.size != 1:
        raise RequestError(f"{field} must hold exactly one string per request, "
                           f"got {array.size} (batch size must be 1)")
    return _utf8(array[0], field)


def text_list(inputs: Mapping[str, np.ndarray], name: str, field: str) -> list[str]:
    """All strings of an optional string-list input (one word each); [] when absent."""
    array = inputs.get(name)
    if array is None:
        return []
    return [_utf8(item, field) for item in np.asarray(array, dtype=object).reshape(-1)]


def encode_words(tokenizer: TextTokenizer, words: Sequence[str], field: str) -> list[list[int]]:
    """Token ids of each word, without special tokens (as they appear inside generated text)."""
    if len(words) > MAX_WORDS:
        raise RequestError(f"{field} has {len(words)} entries, over the limit of {MAX_WORDS}")
    num_chars = sum(len(word) for word in words)
    if num_chars > MAX_WORDS_TOKENS * MAX_CHARS_PER_TOKEN:
        raise RequestError(f"{field} has {num_chars} characters in all, over the limit of "
                           f"{MAX_WORDS_TOKENS * MAX_CHARS_PER_TOKEN}")
    encoded = []
    for word in words:
        ids = list(tokenizer.encode(word, add_special_tokens=False))
        if word and not ids:
            raise RequestError(f"{field}: {word!r} encodes to no tokens")
        if ids:
            encoded.append(ids)
    return encoded


def chat_prompt_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn of the tokenizer's chat template, ready for the
    assistant's answer (`add_generation_prompt`). The template writes its own special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("apply_chat_template: this model's tokenizer has no chat template; "
                           "send the prompt as it is (apply_chat_template false)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def prompt_ids(tokenizer: TextTokenizer, text: str, add_special_tokens: bool,
               limits: Limits, apply_chat_template: bool = False) -> list[int]:
    """Tokenize the prompt (as a chat user turn when asked) and check it against the engine's
    max_input_len (by its length in characters first, so a huge text is never tokenized)."""
    max_chars = limits.max_input_len * MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise RequestError(f"text_input has {len(text)} characters, over the limit of "
                           f"{max_chars} (max_input_len {limits.max_input_len} tokens x "
                           f"{MAX_CHARS_PER_TOKEN}); it was not tokenized")
    if apply_chat_template:
        ids = chat_prompt_ids(tokenizer, text)
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise RequestError("text_input must not be empty")
    if len(ids) > limits.max_input_len:
        raise RequestError(f"text_input has {len(ids)} tokens, over the engine's "
                           f"max_input_len {limits.max_input_len}")
    return ids


def tensorrt_llm_inputs(inputs: Mapping[str, object], ids: list[int], max_tokens: int,
                        stop_words: list[list[int]], bad_words: list[list[int]],
                        streaming: bool) -> dict[str, np.ndarray]:
    """The `tensorrt_llm` model's inputs for one request (batch dimension 1). `inputs`: the
    BLS's input arrays, or plain values by the same names (the OpenAI endpoint's direct path);
    only the names of `PASSTHROUGH_INPUTS` and `LORA_ARRAY_INPUTS` are read."""
    tensors = {
        "input_ids": np.asarray([ids], dtype=np.int32),
        "input_lengths": np.asarray([[len(ids)]], dtype=np.int32),
        "request_output_len": np.asarray([[max_tokens]], dtype=np.int32),
        "stop_words_list": to_word_list(stop_words)[None],
        "bad_words_list": to_word_list(bad_words)[None],
        "streaming": np.asarray([[streaming]], dtype=np.bool_),
    }
    for name, (target, dtype) in PASSTHROUGH_INPUTS.items():
        value = scalar(inputs, name)
        if value is not None:
            tensors[target] = np.asarray([[value]], dtype=dtype)
    for name, dtype in LORA_ARRAY_INPUTS.items():
        if inputs.get(name) is not None:
            array = np.asarray(inputs[name], dtype=dtype)
            tensors[name] = array if array.ndim == 3 else array[None]
    return tensors

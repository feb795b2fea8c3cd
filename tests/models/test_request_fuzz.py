"""Property-based fuzz of the request converters: whatever arrays arrive under the model's input
names (any dtype, shape, NaN/inf, overflowing or negative integers, bytes that are not UTF-8),
parsing either succeeds with a valid request or raises `RequestError` naming an input, never
anything else."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from triton_backend.engine.config import Limits
from triton_backend.engine.request import MAX_TIMEOUT_MS, PRIORITY_MAX, PRIORITY_MIN
from triton_backend.models.request_converter import INPUT_NAMES, RequestError, parse_request
from triton_backend.models.request_converter import check_output_len
from triton_backend.models.text_request import text_list, text_value

LIMITS = Limits(max_batch_size=4, max_num_tokens=256, max_input_len=64, max_seq_len=160)
VOCAB = 383
DTYPES = [np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_, np.int8]

# Values near the edges: 0, -1, vocab bounds, int32/int64 limits, NaN, inf.
EDGE_INTS = st.sampled_from([0, 1, 2, -1, -2, VOCAB - 1, VOCAB, 159, 160, 2**31 - 1, -2**31,
                             2**63 - 1, -2**63, 100, 101, -100, -101, MAX_TIMEOUT_MS,
                             MAX_TIMEOUT_MS + 1])


def arrays():
    def build(dtype):
        kind = np.dtype(dtype).kind
        if kind == "f":
            elements = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                                 st.sampled_from([0.0, 1.0, 0.5, -0.0, 0.25]))
        elif kind == "b":
            elements = st.booleans()
        else:
            info = np.iinfo(dtype)
            elements = st.one_of(st.integers(info.min, info.max), EDGE_INTS.filter(
                lambda v: info.min <= v <= info.max), st.integers(0, 20))
        shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
        return hnp.arrays(dtype, shapes, elements=elements)
    return st.sampled_from(DTYPES).flatmap(build)


def small_valid():
    """A mostly valid request, so the fuzz also reaches the checks after the first ones."""
    return st.fixed_dictionaries({
        "input_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(
            lambda ids: np.asarray([ids], np.int32)),
        "request_output_len": st.integers(-3, 200).map(lambda v: np.asarray([[v]], np.int32)),
    })


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(base=small_valid(),
       extra=st.dictionaries(st.sampled_from(INPUT_NAMES), arrays(), max_size=6),
       timeout_us=st.one_of(st.just(0), st.integers(0, 2**64 - 1)))
def test_parse_request_raises_only_the_field_naming_error(base, extra, timeout_us):
    inputs = dict(base, **extra)
    try:
        parsed = parse_request(inputs, LIMITS, VOCAB, request_timeout_us=timeout_us)
    except RequestError as exc:
        message = str(exc)
        assert any(name in message for name in INPUT_NAMES), message
        return
    if parsed.stop:
        return
    request = parsed.request
    assert 1 <= len(request.input_token_ids) <= LIMITS.max_input_len
    assert all(0 <= t < VOCAB for t in request.input_token_ids)
    assert len(request.input_token_ids) + request.max_tokens <= LIMITS.max_seq_len
    assert PRIORITY_MIN <= request.priority <= PRIORITY_MAX
    assert request.timeout_ms is None or 1 <= request.timeout_ms <= MAX_TIMEOUT_MS
    for words in (request.stop_token_sequences, request.bad_token_sequences):
        assert all(0 <= t < VOCAB for word in words for t in word)


TEXT_FIELDS = ["text_input", "bad_words", "stop_words", "max_tokens"]


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.binary(max_size=12), st.text(max_size=12)),
       count=st.integers(0, 3), max_tokens=st.one_of(st.none(), EDGE_INTS,
                                                     st.floats(allow_nan=True)))
def test_text_inputs_raise_only_the_field_naming_error(value, count, max_tokens):
    array = np.asarray([value] * count, dtype=object).reshape(1, count)
    for call in (lambda: text_value({"text_input": array}, "text_input", "text_input"),
                 lambda: text_list({"stop_words": array}, "stop_words", "stop_words"),
                 lambda: check_output_len(max_tokens, 5, LIMITS)):
        try:
            call()
        except RequestError as exc:
            assert any(name in str(exc) for name in TEXT_FIELDS), str(exc)


def test_word_ids_outside_the_vocabulary_are_refused():
    inputs = {"input_ids": np.asarray([[5, 6]], np.int32),
              "request_output_len": np.asarray([[4]], np.int32),
              "bad_words_list": np.asarray([[[VOCAB + 5], [1]]], np.int32)}
    with pytest.raises(RequestError, match=r"bad_words_list: token id 388 is outside the "
                                           r"vocabulary \[0, 383\)"):
        parse_request(inputs, LIMITS, VOCAB)

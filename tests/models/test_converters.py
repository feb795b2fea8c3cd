"""Pure converters of the Triton models, without Triton: word lists, request parsing, response
tensors, and the stateless incremental detokenizer (streamed chunks == the non-streamed text)."""
import numpy as np
import pytest

from tests.triton_helpers import build_tiny_tokenizer
from triton_backend.engine.config import Limits
from triton_backend.engine.request import FinishReason, Response
from triton_backend.models.detokenizer import (IncrementalDetokenizer, stop_strings_of,
                                               text_delta, visible_text)
from triton_backend.models.request_converter import (RequestDefaults, RequestError, check_output_len,
                                                     parse_request)
from triton_backend.models.response_converter import StreamState, build_outputs, coalesce
from triton_backend.models.text_request import tensorrt_llm_inputs, text_value
from triton_backend.models.word_list import from_word_list, to_word_list

LIMITS = Limits(max_batch_size=4, max_num_tokens=256, max_input_len=8, max_seq_len=20)


def trt_inputs(**extra):
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]]),
              "request_output_len": np.array([[4]], np.int32)}
    inputs.update({k: np.array([[v]]) for k, v in extra.items()})
    return inputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


# -- word lists --------------------------------------------------------------------------------
def test_word_list_round_trip_and_nvidia_layout():
    array = to_word_list([[5, 6], [7]])
    assert array.tolist() == [[5, 6, 7], [2, 3, -1]]
    assert from_word_list(array[None], "stop_words_list") == [[5, 6], [7]]
    assert from_word_list(to_word_list([]), "x") == []


def test_word_list_rejects_bad_offsets_naming_the_field():
    with pytest.raises(ValueError, match="bad_words_list: offsets"):
        from_word_list(np.array([[1, 2], [3, -1]]), "bad_words_list")
    with pytest.raises(ValueError, match=r"stop_words_list must have shape \[2, L\]"):
        from_word_list(np.zeros((3, 2)), "stop_words_list")


# -- request parsing -----------------------------------------------------------------------------
def test_parse_request_builds_the_executor_request():
    parsed = parse_request(trt_inputs(runtime_top_k=1, streaming=True, end_id=9),
                           LIMITS, vocab_size=100)
    request = parsed.request
    assert request.input_token_ids == [5, 6, 7] and request.max_tokens == 4
    assert request.streaming and request.end_ids == [9] and request.sampling.top_k == 1
    assert parsed.exclude_input_in_output is True  # our default: count only generated tokens


def test_end_id_minus_one_ignores_every_end_id():
    """TensorRT-LLM's convention (its benchmarks' fixed output lengths): end_id -1 is no end id."""
    request = parse_request(trt_inputs(end_id=-1), LIMITS, vocab_size=100).request
    assert request.ignore_eos and request.end_ids is None
    assert not parse_request(trt_inputs(end_id=9), LIMITS, vocab_size=100).request.ignore_eos
    with pytest.raises(ValueError, match=r"end_id must be a token id in \[0, 100\), got -2"):
        from triton_backend.engine.validation import validate_request

        validate_request(parse_request(trt_inputs(end_id=-2), LIMITS, 100).request, LIMITS, 100)


def test_defaults_apply_when_inputs_are_absent():
    parsed = parse_request(trt_inputs(), LIMITS, 100, RequestDefaults(temperature=0.5, top_p=0.9))
    assert parsed.request.sampling.temperature == 0.5 and parsed.request.sampling.top_p == 0.9
    assert parsed.request.end_ids is None  # every EOS id of the checkpoint


@pytest.mark.parametrize("change, message", [
    ({"request_output_len": 0}, r"request_output_len \(max_tokens\) must be >= 1, got 0"),
    ({"request_output_len": -3}, r"must be >= 1, got -3"),
    ({"request_output_len": 18}, r"exceeds the engine's max_seq_len 20 \(at most 17"),
    ({"beam_width": 2}, r"beam_width must be 1 \(beam search is not supported\), got 2"),
    ({"num_return_sequences": 3}, "num_return_sequences must be 1"),
    ({"len_penalty": 0.5}, "len_penalty"),
    ({"runtime_top_p": 0.0}, r"runtime_top_p \(top_p\) must be > 0.0"),
    ({"runtime_top_k": -1}, r"runtime_top_k \(top_k\) must be an integer >= 0"),
    ({"temperature": -1.0}, "temperature must be >= 0.0"),
    ({"timeout_ms": 86_400_001},
     r"timeout_ms must be an integer in \[0, 86400000\] \(0: no deadline\), got 86400001"),
    ({"timeout_ms": 2.5}, r"timeout_ms must be an integer, got 2.5"),
    ({"timeout_ms": True}, r"timeout_ms must be an integer in \[0, 86400000\] .*got True"),
    ({"priority": 101}, r"priority must be an integer in \[-100, 100\], got 101"),
    ({"priority": -101}, r"priority must be an integer in \[-100, 100\], got -101"),
])
def test_bad_inputs_are_refused_naming_the_field(change, message):
    inputs = trt_inputs()
    inputs.update({k: np.array([[v]]) for k, v in change.items()})
    with pytest.raises(RequestError, match=message):
        parse_request(inputs, LIMITS, 100)


def test_deadline_and_priority_reach_the_executor_request():
    parsed = parse_request(trt_inputs(timeout_ms=250, priority=-7), LIMITS, 100,
                           arrival_time_ns=123)
    request = parsed.request
    assert (request.timeout_ms, request.timeout_field, request.priority) == (250, "timeout_ms", -7)
    assert request.arrival_time_ns == 123
    # Triton's own request timeout (microseconds) counts too: the earlier deadline wins
    request = parse_request(trt_inputs(timeout_ms=250), LIMITS, 100,
                            request_timeout_us=100_500).request
    assert (request.timeout_ms, request.timeout_field) == (101, "timeout")
    request = parse_request(trt_inputs(timeout_ms=250), LIMITS, 100,
                            request_timeout_us=900_000).request
    assert (request.timeout_ms, request.timeout_field) == (250, "timeout_ms")
    request = parse_request(trt_inputs(timeout_ms=0), LIMITS, 100).request
    assert request.timeout_ms is None and request.priority == 0  # 0: no deadline


def test_prompt_limits_and_vocabulary():
    with pytest.raises(RequestError, match="prompt has 9 tokens, over the engine's max_input_len 8"):
        parse_request({**trt_inputs(), "input_ids": np.ones((1, 9), np.int32),
                       "input_lengths": np.array([[9]])}, LIMITS, 100)
    with pytest.raises(RequestError, match=r"token id 100 is outside the vocabulary \[0, 100\)"):
        parse_request({**trt_inputs(), "input_ids": np.array([[1, 100, 2]])}, LIMITS, 100)
    with pytest.raises(RequestError, match="batch size must be 1"):
        parse_request({**trt_inputs(), "input_ids": np.ones((2, 3), np.int32)}, LIMITS, 100)


def test_stop_request_needs_no_generation_inputs():
    parsed = parse_request({"stop": np.array([[True]])}, LIMITS, 100)
    assert parsed.stop and parsed.request is None


def test_text_value_refuses_non_utf8_naming_the_field():
    with pytest.raises(RequestError, match="text_input is not valid UTF-8"):
        text_value({"text_input": np.array([[b"ok \xff\xfe"]], dtype=object)}, "text_input",
                   "text_input")
    with pytest.raises(RequestError, match="text_input is required"):
        text_value({}, "text_input", "text_input")
    with pytest.raises(RequestError, match="max_tokens must be >= 1, got 0"):
        check_output_len(0, 3, LIMITS)


def test_bls_builds_tensorrt_llm_inputs_with_nvidia_names():
    tensors = tensorrt_llm_inputs({"top_k": np.array([[2]]), "stream": np.array([[True]])},
                                  [1, 2], 5, [[3, 4]], [], streaming=True)
    assert tensors["runtime_top_k"].dtype == np.int32 and tensors["runtime_top_k"][0, 0] == 2
    assert tensors["stop_words_list"].shape == (1, 2, 2)
    assert parse_request(tensors, LIMITS, 100).request.stop_token_sequences == [[3, 4]]


# -- responses -------------------------------------------------------------------------------------
def test_response_tensors_stream_with_a_preceding_window():
    state = StreamState(input_ids=[5, 6], arrival_time_ns=1)
    first = build_outputs(Response(1, [10, 11], False, num_output_tokens=2), state, now_ns=7)
    last = build_outputs(Response(1, [12], True, FinishReason.END_ID, num_output_tokens=3),
                         state, now_ns=9)
    assert first["output_ids"].tolist() == [[[10, 11]]] and first["finish_reason"][0, 0] == b""
    assert last["preceding_output_ids"].tolist() == [[10, 11]]
    assert last["finish_reason"][0, 0] == b"end_id" and last["sequence_length"].tolist() == [[1]]
    assert last["first_token_time_ns"][0, 0] == 7 and last["last_token_time_ns"][0, 0] == 9


def test_input_leads_the_output_when_not_excluded():
    state = StreamState(input_ids=[5, 6], exclude_input_in_output=False)
    out = build_outputs(Response(1, [10], True, FinishReason.LENGTH), state, now_ns=1)
    assert out["output_ids"].tolist() == [[[5, 6, 10]]]


# -- detokenization ------------------------------------------------------------------------------
def test_visible_text_hides_incomplete_characters_and_stop_prefixes():
    assert visible_text("abc\ufffd", final=False) == "abc"
    assert visible_text("abc\n", final=False, stop_strings=["\n\n"]) == "abc"
    assert visible_text("abc\n\n", final=True, stop_strings=["\n\n"],
                        finish_reason="stop_words") == "abc"
    assert visible_text("abc\n", final=True, stop_strings=["\n\n"], finish_reason="length") \
        == "abc\n"


@pytest.mark.parametrize("text", ["Héllo wörld, ça va? Ünïcödé!", "日本語のテキスト 🙂🚀 end",
                                  "The quick brown fox jumps over the lazy dog."])
def test_streamed_chunks_concatenate_to_the_whole_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = text_delta(tokenizer, [], ids, "length")
    assert whole == text
    for chunk_size in (1, 2, 3):
        detok, pieces = IncrementalDetokenizer(tokenizer), []
        for start in range(0, len(ids), chunk_size):
            final = start + chunk_size >= len(ids)
            pieces.append(detok.add(ids[start:start + chunk_size], "length" if final else ""))
        assert "".join(pieces) == whole
        assert all("\ufffd" not in piece for piece in pieces)  # no split characters


def test_windowed_stateless_deltas_match_the_stateful_ones(tokenizer):
    ids = tokenizer.encode("日本語 🙂 " * 30, add_special_tokens=False)
    pieces = [text_delta(tokenizer, ids[:i], ids[i:i + 1], "length" if i == len(ids) - 1 else "")
              for i in range(len(ids))]
    assert "".join(pieces) == "日本語 🙂 " * 30


def test_stop_string_is_trimmed_in_streams_too(tokenizer):
    stop_ids = tokenizer.encode(" lazy", add_special_tokens=False)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy", add_special_tokens=False)
    stops = stop_strings_of(tokenizer, [stop_ids])
    detok = IncrementalDetokenizer(tokenizer, stops)
    pieces = [detok.add([t], "stop_words" if i == len(ids) - 1 else "")
              for i, t in enumerate(ids)]
    assert "".join(pieces) == "The quick brown fox jumps over the"
    assert text_delta(tokenizer, [], ids, "stop_words", stops) == "".join(pieces)


def test_build_outputs_makes_only_the_requested_outputs_and_still_advances_the_stream():
    state = StreamState(input_ids=[1, 2, 3], stop_words=[[7]])
    first = build_outputs(Response(1, [5], False, num_output_tokens=1), state, 10,
                          frozenset({"output_ids", "preceding_output_ids"}))
    assert sorted(first) == ["output_ids", "preceding_output_ids"]
    second = build_outputs(Response(1, [6], True, FinishReason.LENGTH, num_output_tokens=2),
                           state, 20, frozenset({"preceding_output_ids", "finish_reason"}))
    assert second["preceding_output_ids"].tolist() == [[5]]
    assert second["finish_reason"].reshape(-1)[0] == b"length"
    every = build_outputs(Response(1, [], True, FinishReason.LENGTH), state, 30)
    assert len(every) == 23 and "cancel_key" in every  # without a wish list: every output


def test_perf_metric_outputs_carry_cache_reuse_and_draft_acceptance():
    response = Response(1, [5], True, FinishReason.LENGTH, num_reused_blocks=3, num_new_blocks=2,
                        num_draft_tokens=8, num_accepted_draft_tokens=6)
    out = build_outputs(response, StreamState(input_ids=[1]), 0)
    assert out["kv_cache_reused_blocks"].tolist() == [[3]]
    assert out["kv_cache_alloc_new_blocks"].tolist() == [[2]]
    assert out["kv_cache_alloc_total_blocks"].tolist() == [[5]]
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"][0, 0] == 0.75
    assert out["total_draft_tokens"].tolist() == [[8]]
    assert out["total_accepted_draft_tokens"].tolist() == [[6]]


def test_responses_of_one_request_waiting_together_go_out_as_one():
    waiting = [Response(1, [10], False, log_probs=[-0.1], num_output_tokens=1),
               Response(2, [20], False, num_output_tokens=1),
               Response(1, [11], False, log_probs=[-0.2], num_output_tokens=2),
               Response(1, [12], True, FinishReason.LENGTH, log_probs=[-0.3],
                        num_output_tokens=3, cum_log_prob=-0.6),
               Response(2, [], True, FinishReason.ERROR, error="boom", num_output_tokens=1),
               Response(3, [30], False, num_output_tokens=1)]
    out = coalesce(waiting)
    assert [(r.request_id, r.output_token_ids, r.is_final) for r in out] == [
        (1, [10, 11, 12], True), (2, [20], False), (2, [], True), (3, [30], False)]
    assert out[0].log_probs == [-0.1, -0.2, -0.3] and out[0].num_output_tokens == 3
    assert out[0].finish_reason is FinishReason.LENGTH and out[0].cum_log_prob == -0.6
    assert out[2].error == "boom"  # an error is never merged: the tokens before it went first
    # a stream built from the merged response is the stream of the separate ones
    state_a, state_b = StreamState(input_ids=[1, 2]), StreamState(input_ids=[1, 2])
    separate = [build_outputs(r, state_a, now_ns=5) for r in waiting if r.request_id == 1]
    whole = build_outputs(out[0], state_b, now_ns=5)
    assert np.concatenate([o["output_ids"].reshape(-1) for o in separate]).tolist() == \
        whole["output_ids"].reshape(-1).tolist() == [10, 11, 12]
    assert coalesce([]) == []


# -- guided decoding inputs ----------------------------------------------------------------------
def _guided(**values):
    return {**trt_inputs(), **{k: np.array([[v.encode()]], dtype=object) for k, v in values.items()}}


def test_guided_decoding_inputs_become_the_requests_guide():
    from triton_backend.engine.guided import GuidedDecodingParams

    request = parse_request(_guided(guided_decoding_guide_type="regex",
                                    guided_decoding_guide="[0-9]+"), LIMITS, 100).request
    assert request.guided_decoding == GuidedDecodingParams("regex", "[0-9]+")
    request = parse_request(_guided(guided_decoding_guide_type="json"), LIMITS, 100).request
    assert request.guided_decoding == GuidedDecodingParams("json", "")
    assert parse_request(trt_inputs(), LIMITS, 100).request.guided_decoding is None


@pytest.mark.parametrize("values, message", [
    ({"guided_decoding_guide": "[0-9]+"}, "guided_decoding_guide needs guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "yaml", "guided_decoding_guide": "a: 1"},
     "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar, got 'yaml'"),
    ({"guided_decoding_guide_type": "ebnf_grammar"},
     "guided_decoding_guide is required for guided_decoding_guide_type ebnf_grammar"),
])
def test_bad_guided_decoding_inputs_name_the_field(values, message):
    with pytest.raises(RequestError, match=message):
        parse_request(_guided(**values), LIMITS, 100)
    # the BLS and the OpenAI direct path pass both inputs through to tensorrt_llm as strings
    tensors = tensorrt_llm_inputs(_guided(**values), [5, 6], 4, [], [], False)
    assert {k: tensors[k][0, 0].decode() for k in values} == values


@pytest.mark.parametrize("value, message", [
    (np.array([[-1]], dtype=np.int32), r"guided_decoding_guide_type must be UTF-8 text \(a BYTES input\), got -1"),
    (np.array([[5]], dtype=np.int64), r"guided_decoding_guide_type must be UTF-8 text \(a BYTES input\), got 5"),
    (np.array([[b"\xff"]], dtype=object), r"guided_decoding_guide_type must be UTF-8 text$"),
])
def test_a_guide_type_that_is_not_text_is_refused_naming_the_field(value, message):
    inputs = {**trt_inputs(), "guided_decoding_guide_type": value}
    with pytest.raises(RequestError, match=message):
        parse_request(inputs, LIMITS, 100)


def test_top_log_probs_input_and_outputs():
    assert parse_request(trt_inputs(top_log_probs=3), LIMITS, 100).request.top_log_probs == 3
    with pytest.raises(RequestError, match=r"top_log_probs must be an integer in \[0, 20\], got 21"):
        parse_request(trt_inputs(top_log_probs=21), LIMITS, 100)
    state = StreamState(input_ids=[1, 2], exclude_input_in_output=False)
    response = Response(1, [5, 6], False, top_ids=[[5, 9], [6, 3]],
                        top_log_probs=[[-0.1, -2.5], [-0.2, -1.9]])
    out = build_outputs(response, state, 0)
    # prompt tokens lead output_ids here, so their alternatives are placeholders
    assert out["output_top_ids"].tolist() == [[[-1, -1], [-1, -1], [5, 9], [6, 3]]]
    assert out["output_top_log_probs"].shape == (1, 4, 2)
    merged = coalesce([response, Response(1, [7], True, FinishReason.LENGTH, top_ids=[[7, 1]],
                                          top_log_probs=[[-0.3, -1.0]])])
    assert merged[0].top_ids == [[5, 9], [6, 3], [7, 1]]
    # none asked for: empty
    assert build_outputs(Response(1, [5], True), StreamState([1]), 0)["output_top_ids"].shape \
        == (1, 0, 0)

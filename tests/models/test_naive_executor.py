"""The naive baseline: `forge engine --target naive` layout and NaiveExecutor's executor verbs,
checked against `transformers` generate on a tiny random Llama checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

import tiny
from builder.pipeline.naive import build_naive_engine
from builder.spec.load import spec_from_dict
from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.guided import GuidedDecodingParams
from triton_backend.naive import NaiveExecutor

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_checkpoint(tmp_path_factory.mktemp("naive") / "hf", "llama_gqa")


@pytest.fixture(scope="module")
def engine_dir(checkpoint, tmp_path_factory):
    spec = spec_from_dict({"name": "tiny-naive", "checkpoint": str(checkpoint), "target": "naive",
                           "dtype": "float32",
                           "limits": {"max_input_len": 64, "max_seq_len": 128}})
    return build_naive_engine(spec, checkpoint, tmp_path_factory.mktemp("eng") / "naive",
                              log=lambda _: None)


@pytest.fixture(scope="module")
def executor(engine_dir):
    ex = NaiveExecutor(engine_dir)
    yield ex
    ex.shutdown()


def _collect(executor, request_id, timeout=60.0):
    responses = []
    while not (responses and responses[-1].is_final):
        got = executor.await_responses(request_id, timeout=timeout)
        assert got, "no response within the timeout"
        responses.extend(got)
    return responses


def _hf_greedy(checkpoint, prompt, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early, never mask the eos id
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_engine_dir_layout(engine_dir):
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["target"] == "naive" and config["dtype"] == "float32"
    assert config["limits"]["max_input_len"] == 64
    assert (engine_dir / "hf" / "config.json").is_file()
    assert (engine_dir / "hf" / "model.safetensors").is_file()
    assert (engine_dir / "tokenizer" / "tokenizer.json").is_file()
    assert (engine_dir / "manifest.json").is_file()
    assert not list(engine_dir.parent.glob(".*partial*"))  # no staging directory left


def test_build_refuses_another_target(checkpoint, tmp_path):
    spec = spec_from_dict({"name": "t", "checkpoint": str(checkpoint), "target": "torch"})
    with pytest.raises(ValueError, match="target"):
        build_naive_engine(spec, checkpoint, tmp_path / "x", log=lambda _: None)


def test_greedy_matches_transformers_and_streams_token_by_token(executor, checkpoint):
    expected = _hf_greedy(checkpoint, PROMPT, 12)
    rid = executor.enqueue_request(Request(PROMPT, 12, ignore_eos=True))
    [final] = _collect(executor, rid)
    assert final.output_token_ids == expected
    assert final.finish_reason == FinishReason.LENGTH and final.num_output_tokens == 12

    rid = executor.enqueue_request(Request(PROMPT, 12, streaming=True, ignore_eos=True,
                                           return_log_probs=True))
    responses = _collect(executor, rid)
    assert [len(r.output_token_ids) for r in responses[:-1]] == [1] * 12
    assert [r.num_output_tokens for r in responses[:-1]] == list(range(1, 13))
    assert [t for r in responses for t in r.output_token_ids] == expected
    assert responses[-1].output_token_ids == [] and responses[-1].finish_reason == FinishReason.LENGTH
    assert all(r.log_probs and r.log_probs[0] <= 0 for r in responses[:-1])


def test_end_ids_min_tokens_and_stop_words(executor, checkpoint):
    expected = _hf_greedy(checkpoint, PROMPT, 12)
    end = expected[3]
    first = expected.index(end)
    rid = executor.enqueue_request(Request(PROMPT, 12, end_ids=[end]))
    [final] = _collect(executor, rid)
    assert final.output_token_ids == expected[:first + 1]
    assert final.finish_reason == FinishReason.END_ID

    rid = executor.enqueue_request(Request(PROMPT, 12, end_ids=[end], ignore_eos=True))
    assert _collect(executor, rid)[-1].output_token_ids == expected

    stop = expected[4:6]
    rid = executor.enqueue_request(Request(PROMPT, 12, stop_token_sequences=[stop], end_ids=[]))
    [final] = _collect(executor, rid)
    assert final.finish_reason == FinishReason.STOP_WORDS
    assert final.output_token_ids[-2:] == stop and len(final.output_token_ids) <= 6


def test_seeded_sampling_is_reproducible(executor):
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=7)
    outs = []
    for _ in range(2):
        rid = executor.enqueue_request(Request(PROMPT, 10, sampling=sampling, ignore_eos=True))
        outs.append(_collect(executor, rid)[-1].output_token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 10


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(input_token_ids=[], max_tokens=4), "input_token_ids"),
    (dict(input_token_ids=[1] * 65, max_tokens=4), "max_input_len"),
    (dict(input_token_ids=[10**6], max_tokens=4), "input_token_ids"),
    (dict(input_token_ids=[1, 2], max_tokens=0), "max_tokens"),
    (dict(input_token_ids=[1] * 60, max_tokens=100), "max_seq_len"),
    (dict(input_token_ids=[1, 2], max_tokens=4, stop_token_sequences=[[]]), "stop_words"),
    (dict(input_token_ids=[1, 2], max_tokens=4,
          guided_decoding=GuidedDecodingParams("regex", "a+")), "guided_decoding_guide_type: "
                                                                 "guided decoding is not supported"),
    (dict(input_token_ids=[1, 2], max_tokens=4, top_log_probs=2), "top_log_probs"),
])
def test_bad_requests_name_the_field(executor, request_kwargs, field):
    with pytest.raises(ValueError, match=field):
        executor.enqueue_request(Request(**request_kwargs))


def test_cancel_queued_and_running(executor):
    running = executor.enqueue_request(Request(PROMPT, 100, streaming=True, ignore_eos=True))
    queued = executor.enqueue_request(Request(PROMPT, 100, ignore_eos=True))
    executor.cancel_request(queued)
    [cancelled] = _collect(executor, queued)
    assert cancelled.finish_reason == FinishReason.CANCELLED and cancelled.output_token_ids == []
    assert executor.await_responses(running, timeout=60)  # it is generating
    executor.cancel_request(running)
    responses = _collect(executor, running)
    assert responses[-1].finish_reason == FinishReason.CANCELLED
    assert responses[-1].num_output_tokens < 100
    stats = executor.get_stats()
    assert stats["num_cancelled_requests"] >= 2 and stats["max_num_seqs_in_step"] == 1
    # still serving afterwards
    rid = executor.enqueue_request(Request(PROMPT, 3, ignore_eos=True))
    assert len(_collect(executor, rid)[-1].output_token_ids) == 3


def test_shutdown_cancels_what_is_left(engine_dir):
    ex = NaiveExecutor(engine_dir)
    ids = [ex.enqueue_request(Request(PROMPT, 60, ignore_eos=True)) for _ in range(3)]
    ex.shutdown()
    finals = {r.request_id: r for r in ex.await_responses(timeout=1) if r.is_final}
    assert set(finals) == set(ids)
    assert finals[ids[-1]].finish_reason == FinishReason.CANCELLED
    with pytest.raises(RuntimeError):
        ex.enqueue_request(Request(PROMPT, 2))

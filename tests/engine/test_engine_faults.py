"""Failures inside the engine end only the requests they concern; the engine goes on serving.

Probes from review: extreme sampling values are refused at the door with the field named, NaN/inf
logits never reach the sampler's draw, a step that raises fails only its batch, a crash of the
loop itself restarts it in place (up to the crash-loop limit)."""
import math
import time

import pytest
import torch

from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.executor import Executor
from triton_backend.engine.faults import FAULT_FILE_ENV, inject
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate
from triton_backend.engine.sampler import Sampler, SamplingError
from triton_backend.engine.scheduler import ScheduledChunk
from triton_backend.engine.supervision import CrashLoop, RestartPolicy
from triton_backend.engine.validation import MAX_WORDS, MAX_WORDS_TOKENS

from tiny import final_response


@pytest.mark.parametrize("make_params, message", [
    (lambda: SamplingParams(temperature=1e-38), "temperature must be 0 (greedy) or within [0.01"),
    (lambda: SamplingParams(temperature=1e6), "temperature must be 0 (greedy) or within"),
    (lambda: SamplingParams(repetition_penalty=1e-38), "repetition_penalty must be >= 0.01"),
    (lambda: SamplingParams(repetition_penalty=1e9), "repetition_penalty must be <= 100.0"),
    (lambda: SamplingParams(frequency_penalty=-3e38), "frequency_penalty must be >= -100.0"),
    (lambda: SamplingParams(presence_penalty=3e38), "presence_penalty must be <= 100.0"),
    (lambda: SamplingParams(temperature=float("nan")), "temperature"),
])
def test_extreme_sampling_values_are_refused_naming_the_field(make_params, message):
    with pytest.raises(ValueError) as err:
        make_params()
    assert message in str(err.value)


def test_end_id_outside_the_vocabulary_and_word_limits_are_refused(tiny_engines):
    engine = LLMEngine(tiny_engines("llama_gqa"))
    vocab = engine.config.model.vocab_size
    bad = [
        (Request([5], 4, SamplingParams(min_tokens=2), end_ids=[vocab + 7]),
         f"end_id must be a token id in [0, {vocab}), got {vocab + 7}"),
        (Request([5], 4, SamplingParams(min_tokens=5)), "min_tokens (5) must be <= max_tokens (4)"),
        (Request([5], 4, stop_token_sequences=[[7]] * 50_000),
         f"stop_words has 50000 entries, over the limit of {MAX_WORDS}"),
        (Request([5], 4, bad_token_sequences=[[7] * 200] * 10),
         f"bad_words has 2000 tokens in all, over the limit of {MAX_WORDS_TOKENS}"),
    ]
    for request, message in bad:
        with pytest.raises(ValueError) as err:
            engine.validate(request)
        assert message in str(err.value)


def _chunk(seq_id, params):
    request = Request([1], 4, params)
    return ScheduledChunk(seq_id, [1], 0, [], True, request, [1], 1)


def test_non_finite_logits_never_reach_the_draw():
    sampler = Sampler()
    logits = torch.zeros(3, 10)
    logits[0, 3] = float("inf")   # +inf becomes the largest float: token 3 wins
    logits[1, :] = float("nan")   # nothing left to choose: this row alone fails
    logits[2, 5] = 4.0
    logits[2, 6] = float("nan")   # NaN is never drawn
    chunks = [_chunk(1, SamplingParams(temperature=0.7, seed=1)),
              _chunk(2, SamplingParams(temperature=0.7, seed=2)),
              _chunk(3, SamplingParams(temperature=0.5, seed=3))]
    eos = {1: frozenset(), 2: frozenset(), 3: frozenset()}
    with pytest.raises(SamplingError) as err:
        sampler(logits, chunks, eos)
    assert set(err.value.failures) == {2}
    assert "no token can be chosen" in err.value.failures[2]
    for _ in range(20):
        picks = sampler(logits[[0, 2]], [chunks[0], chunks[2]], eos)
        assert picks[0][0] == 3 and math.isfinite(picks[0][1])
        assert picks[1][0] != 6 and math.isfinite(picks[1][1])
    greedy = sampler(logits[[2]], [_chunk(4, SamplingParams())], {4: frozenset()})
    assert greedy[0][0] == 5 and math.isfinite(greedy[0][1])


def test_a_failing_step_fails_its_batch_and_the_engine_serves_the_next(tiny_engines, tmp_path,
                                                                        monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    engine_dir = tiny_engines("llama_gqa")
    ex = Executor(engine_dir, kv_cache_num_blocks=64)
    try:
        rid = ex.enqueue_request(Request([5, 6, 7], 200, streaming=True, ignore_eos=True))
        assert ex.await_responses(rid, timeout=60)  # running
        inject(fault, "oom:injected out of memory")
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.ERROR
        assert "the engine step failed: MemoryError: injected out of memory" in final.error
        assert not fault.exists()
        request = Request([5, 6, 7], 6, ignore_eos=True)
        expected = generate(LLMEngine(engine_dir), [request])[0].output_ids
        rid = ex.enqueue_request(request)
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.LENGTH and final.output_token_ids == expected
        stats = ex.get_stats()
        assert stats["num_failed_steps"] == 1 and stats["num_failed_requests"] == 1
        assert stats["num_used_blocks"] == 0  # the failed request's blocks were freed
    finally:
        ex.shutdown()


def test_a_crashed_loop_restarts_in_place_until_the_crash_loop_limit(tiny_engines, tmp_path,
                                                                      monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    ex = Executor(tiny_engines("llama_gqa"), kv_cache_num_blocks=64,
                  restart_policy=RestartPolicy(max_restarts=1, window_seconds=600))
    try:
        rid = ex.enqueue_request(Request([5, 6, 7], 200, streaming=True, ignore_eos=True))
        assert ex.await_responses(rid, timeout=60)
        inject(fault, "loop:boom")
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.ERROR
        assert "internal error in the engine loop: InjectedFault: boom" in final.error
        rid = ex.enqueue_request(Request([5, 6], 3, ignore_eos=True))
        assert final_response(ex, rid).num_output_tokens == 3
        assert ex.get_stats()["num_loop_restarts"] == 1 and ex.is_alive()
        inject(fault, "loop:again")  # seen when the loop next wakes: on this request
        rid = ex.enqueue_request(Request([5, 6], 3, ignore_eos=True))
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.ERROR and "again" in final.error
        deadline = time.monotonic() + 30
        while ex.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ex.is_alive()
        with pytest.raises(RuntimeError, match="the engine loop crashed: .*again.*2 crashes"):
            ex.enqueue_request(Request([5], 2))
    finally:
        ex.shutdown()


def test_crash_loop_counts_only_crashes_within_the_window():
    now = [0.0]
    loop = CrashLoop(RestartPolicy(max_restarts=2, window_seconds=10), clock=lambda: now[0])
    assert loop.allow_restart() and loop.allow_restart()
    now[0] = 5.0
    assert not loop.allow_restart()  # 3 within 10 s
    now[0] = 100.0
    assert loop.allow_restart()      # the old ones aged out
    with pytest.raises(ValueError, match="engine_max_restarts must be an integer >= 0"):
        RestartPolicy(max_restarts=-1)

"""Admission limits and deadlines in the engine and the executor (tiny engine, injected clock
where time matters; no sleeps)."""
import re

import pytest

from triton_backend.engine import FinishReason, Request
from triton_backend.engine.admission import AdmissionLimits, ServerBusy
from triton_backend.engine.executor import Executor
from triton_backend.engine.llm_engine import LLMEngine

from scheduling import Clock
from tiny import final_response

MS = 1_000_000


def test_admission_limits_count_requests_then_prompt_tokens():
    limits = AdmissionLimits(max_waiting_requests=3, max_waiting_prompt_tokens=10)
    limits.check(2, 4, 6)  # 3 requests and 10 tokens would wait: at the limits, admitted
    with pytest.raises(ServerBusy) as err:
        limits.check(3, 0, 1)
    assert str(err.value) == "server busy: 3 requests waiting (limit 3)"
    with pytest.raises(ServerBusy) as err:
        limits.check(1, 6, 5)
    assert str(err.value) == "server busy: 6 prompt tokens waiting (limit 10), this prompt adds 5"
    limits.check(0, 0, 50)  # nothing waits: a long prompt is never refused for good
    AdmissionLimits().check(10_000, 10**9, 10**6)  # 0 = unbounded


@pytest.mark.parametrize("field", ["max_waiting_requests", "max_waiting_prompt_tokens"])
def test_admission_limits_are_validated_naming_the_field(field):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 0 \\(0: unbounded\\), "
                                         f"got -1"):
        AdmissionLimits(**{field: -1})


def test_the_executor_refuses_what_would_wait_over_its_limits(tiny_engines):
    # The loop is not started: everything enqueued waits, so the counts are exact.
    executor = Executor(tiny_engines("llama_gqa"), kv_cache_num_blocks=64, start_loop=False,
                        admission=AdmissionLimits(max_waiting_requests=3,
                                                  max_waiting_prompt_tokens=12))
    executor.enqueue_request(Request([5] * 6, 2))
    with pytest.raises(ServerBusy, match=re.escape(
            "server busy: 6 prompt tokens waiting (limit 12), this prompt adds 7")):
        executor.enqueue_request(Request([5] * 7, 2))
    executor.enqueue_request(Request([5] * 4, 2))
    executor.enqueue_request(Request([5] * 2, 2))
    with pytest.raises(ServerBusy, match=re.escape("server busy: 3 requests waiting (limit 3)")):
        executor.enqueue_request(Request([5], 2))
    # refusals take nothing: three requests wait, none was dropped
    assert executor.get_stats()["num_queued_requests"] == 3


def test_requests_in_the_scheduler_count_as_waiting(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    executor = Executor(engine_dir, kv_cache_num_blocks=64, start_loop=False,
                        admission=AdmissionLimits(max_waiting_requests=2))
    for _ in range(2):  # as if the loop had moved them into the scheduler already
        executor.engine.add_request(Request([5, 6], 2))
    with pytest.raises(ServerBusy, match=re.escape("server busy: 2 requests waiting (limit 2)")):
        executor.enqueue_request(Request([5], 2))


def test_a_waiting_request_past_its_deadline_ends_with_the_error_and_frees_its_blocks(
        tiny_engines):
    clock = Clock()
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=64, clock=clock)
    seq_id = engine.add_request(Request([5, 6, 7], 4, timeout_ms=100))
    clock.now = 99 * MS
    assert engine.expire() == []
    clock.now = 150 * MS
    [response] = engine.expire()
    assert response.request_id == seq_id and response.is_final
    assert response.finish_reason == FinishReason.ERROR
    assert response.error == "timeout_ms: request exceeded its deadline of 100 ms (waited 150 ms)"
    assert not engine.has_work() and engine.get_stats()["num_timed_out_requests"] == 1


def test_a_running_request_past_its_deadline_ends_with_the_error_and_frees_its_blocks(
        tiny_engines):
    clock = Clock()
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=64, clock=clock)
    free_before = engine.block_manager.num_free_blocks
    seq_id = engine.add_request(Request([5, 6, 7], 40, arrival_time_ns=0, timeout_ms=1000,
                                        ignore_eos=True))
    other = engine.add_request(Request([8, 9], 40, ignore_eos=True))
    clock.now = 30 * MS  # first admitted at 30 ms
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    clock.now = 1200 * MS
    [response] = engine.expire()
    assert response.request_id == seq_id and response.num_output_tokens == 2
    assert response.error == ("timeout_ms: request exceeded its deadline of 1000 ms "
                              "(waited 30 ms, ran 1170 ms)")
    assert seq_id not in engine.sequences and other in engine.sequences  # only that one
    engine.abort(other)
    assert engine.block_manager.num_free_blocks == free_before


def test_the_deadline_names_the_field_that_set_it(tiny_engines):
    clock = Clock()
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=64, clock=clock)
    engine.add_request(Request([5], 4, timeout_ms=2, timeout_field="timeout"))
    clock.now = 5 * MS
    [response] = engine.expire()
    assert response.error == "timeout: request exceeded its deadline of 2 ms (waited 5 ms)"


def test_the_executor_loop_ends_expired_requests_with_the_error(tiny_engines):
    import time

    executor = Executor(tiny_engines("llama_gqa"), kv_cache_num_blocks=64)
    try:
        # arrived ten seconds ago with a one-second deadline: past it before it is scheduled
        late = executor.enqueue_request(Request([5, 6], 4, timeout_ms=1000,
                                                arrival_time_ns=time.time_ns() - 10_000 * MS))
        on_time = executor.enqueue_request(Request([5, 6], 4, timeout_ms=600_000))
        response = final_response(executor, late)
        assert re.fullmatch(r"timeout_ms: request exceeded its deadline of 1000 ms "
                            r"\(waited \d+ ms\)", response.error), response.error
        assert final_response(executor, on_time).error is None
        assert executor.get_stats()["num_used_blocks"] == 0
    finally:
        executor.shutdown()


@pytest.mark.parametrize("request_kwargs, message", [
    ({"priority": 101}, "priority must be an integer in [-100, 100], got 101"),
    ({"priority": True}, "priority must be an integer in [-100, 100], got True"),
    ({"timeout_ms": 0}, "timeout_ms must be an integer in [1, 86400000] ms, got 0"),
    ({"timeout_ms": 10**12}, "timeout_ms must be an integer in [1, 86400000] ms, got "),
])
def test_priority_and_timeout_are_validated_naming_the_field(tiny_engines, request_kwargs,
                                                             message):
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=64)
    with pytest.raises(ValueError) as err:
        engine.validate(Request([5], 4, **request_kwargs))
    assert message in str(err.value)

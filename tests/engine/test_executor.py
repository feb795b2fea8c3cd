"""The executor, in both isolations (its own engine process, or a thread of the caller):
concurrent clients, streaming, cancellation, bad input, stats, shutdown."""
import threading

import pytest

from triton_backend.engine import FinishReason, Request, SamplingParams
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate
from triton_backend.models.executor_factory import create_executor

ISOLATIONS = ["thread", "process"]


def collect(executor, request_id: int, timeout: float = 60.0):
    responses = []
    while not (responses and responses[-1].is_final):
        got = executor.await_responses(request_id, timeout=timeout)
        assert got, f"no response for request {request_id} within {timeout}s"
        responses.extend(got)
    return responses


@pytest.fixture(params=ISOLATIONS)
def executor(tiny_engines, request):
    ex = create_executor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=128), isolation=request.param)
    yield ex
    ex.shutdown()


@pytest.mark.parametrize("make_request, message", [
    (lambda: Request([], 4), "input_token_ids: the prompt is empty"),
    (lambda: Request(list(range(1, 130)), 4), "more than max_input_len=128"),
    (lambda: Request([5], 0), "max_tokens must be >= 1, got 0"),
    (lambda: Request([5], -3), "max_tokens must be >= 1, got -3"),
    (lambda: Request([5] * 100, 200), "exceeds the engine's max_seq_len 256 (at most 156 for"),
    (lambda: Request([5, 99999], 4), "input_token_ids: token ids must be integers in [0, "),
    (lambda: Request([5], 4, stop_token_sequences=[[]]), "stop_words: each entry"),
    (lambda: Request([5], 4, SamplingParams(top_p=0.0)), "top_p must be > 0.0, got 0.0"),
    (lambda: Request([5], 4, SamplingParams(top_p=1.5)), "top_p must be <= 1.0, got 1.5"),
    (lambda: Request([5], 4, SamplingParams(temperature=-1)), "temperature must be >= 0.0"),
    (lambda: Request([5], 4, SamplingParams(beam_width=2)), "beam_width must be 1"),
    (lambda: Request([5], 4, SamplingParams(top_k=-1)), "top_k must be an integer >= 0"),
])
def test_bad_requests_are_refused_and_the_executor_keeps_serving(executor, make_request, message):
    with pytest.raises(ValueError) as err:
        executor.enqueue_request(make_request())
    assert message in str(err.value)
    rid = executor.enqueue_request(Request([5, 6, 7], 3, ignore_eos=True))
    final = collect(executor, rid)[-1]
    assert final.is_final and final.num_output_tokens == 3


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_kv_budget_too_small_for_one_request_is_refused(tiny_engines, isolation):
    ex = create_executor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=4), isolation=isolation)  # 4 blocks x 8 tokens
    try:
        with pytest.raises(ValueError, match="needs 5 KV blocks but the cache holds 4"):
            ex.enqueue_request(Request([5] * 20, 20))
    finally:
        ex.shutdown()


def test_sixteen_concurrent_clients_get_their_solo_ids(tiny_engines, executor):
    prompts = [list(range(3 + i, 10 + 3 * i)) for i in range(16)]
    requests = [Request(p, 8 + i, streaming=i % 2 == 0, ignore_eos=True)
                for i, p in enumerate(prompts)]
    solo = LLMEngine(tiny_engines("llama_gqa"))
    expected = [generate(solo, [r])[0].output_ids for r in requests]
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        rid = executor.enqueue_request(requests[i])
        responses = collect(executor, rid)
        results[i] = [t for r in responses for t in r.output_token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(16)] == expected
    stats = executor.get_stats()
    assert stats["max_num_seqs_in_step"] > 1
    assert stats["num_used_blocks"] == 0 and stats["num_completed_requests"] == 16


def test_cancel_streaming_request(executor):
    rid = executor.enqueue_request(Request([5, 6, 7], 200, streaming=True, ignore_eos=True))
    first = executor.await_responses(rid, timeout=30)
    assert first and not first[-1].is_final
    executor.cancel_request(rid)
    final = collect(executor, rid)[-1]
    assert final.finish_reason == FinishReason.CANCELLED and final.num_output_tokens < 200
    other = executor.enqueue_request(Request([9, 10], 4, ignore_eos=True))
    assert collect(executor, other)[-1].finish_reason == FinishReason.LENGTH
    assert executor.get_stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_shutdown_ends_requests_in_flight_with_a_final_response(tiny_engines, isolation):
    ex = create_executor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=128), isolation=isolation)
    rid = ex.enqueue_request(Request([5, 6, 7], 240, streaming=True, ignore_eos=True))
    assert ex.await_responses(rid, timeout=30)
    ex.shutdown()
    final = [r for r in ex.await_responses(rid, timeout=5) if r.is_final]
    assert final and final[0].finish_reason == FinishReason.CANCELLED
    with pytest.raises(RuntimeError, match="shut down"):
        ex.enqueue_request(Request([5], 2))


def test_requests_admitted_while_a_gpu_step_runs_are_served(tiny_engines):
    """The loop a GPU engine runs: requests that arrive while a step computes join the waiting
    queue from the step's `while_running` hook (here on the CPU, the hook called as on a GPU);
    each client still gets its solo ids, and one the engine refuses there gets its error."""
    from triton_backend.engine.executor import Executor

    engine_dir = tiny_engines("llama_gqa")
    executor = Executor(engine_dir, kv_cache_num_blocks=128, start_loop=False)
    executor._overlap = executor._admit_while_running
    calls = []
    step = executor.engine.step

    def counted(**kwargs):
        calls.append(kwargs.get("while_running") is not None)
        return step(**kwargs)

    executor.engine.step = counted
    threading.Thread(target=executor.run_loop, daemon=True).start()
    try:
        requests = [Request(list(range(3 + i, 12 + i)), 6 + i, ignore_eos=True)
                    for i in range(6)]
        solo = LLMEngine(engine_dir)
        expected = [generate(solo, [r])[0].output_ids for r in requests]
        results = {}

        def client(i: int) -> None:
            rid = executor.enqueue_request(requests[i])
            results[i] = [t for r in collect(executor, rid) for t in r.output_token_ids]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(6)] == expected
        rid = executor.enqueue_request(Request([5, 6], 2, lora_task_id=3))  # no adapters here
        final = collect(executor, rid)[-1]
        assert final.finish_reason == FinishReason.ERROR
        assert "serves no LoRA adapters" in final.error
        assert calls and all(calls)
    finally:
        executor.shutdown()


def test_a_request_is_validated_once_on_its_way_into_the_engine(tiny_engines, monkeypatch):
    """Once per hop: the executor checks at enqueue and its loop admits without checking again."""
    from triton_backend.engine import llm_engine

    calls, check = [], llm_engine.validate_request
    monkeypatch.setattr(llm_engine, "validate_request", lambda *a: calls.append(a) or check(*a))
    ex = create_executor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=128),
                         isolation="thread")
    try:
        final = collect(ex, ex.enqueue_request(Request([5, 6, 7], 3, ignore_eos=True)))[-1]
        assert final.error is None and final.num_output_tokens == 3 and len(calls) == 1
    finally:
        ex.shutdown()

"""The engine process's watchdog: a frozen engine is killed and restarted in place, a slow one is not.

A frozen engine is one whose loop makes no progress: the process stopped (SIGSTOP), or its main
thread hung inside a step while the rest of the process lives on (the `hang` fault). Either way
every request in flight ends with an error naming the freeze within the issue's 10 s, a new
engine process serves the next request as the old one did, and nothing of the old one is left in
the counters. Work that takes long but moves (a step slowed on purpose, a full `max_num_tokens`
prefill beside a busy process) is never taken for a freeze.

Times are printed (run with -s), never asserted beyond the issue's bound. The engines run the
pure-torch paths: the watchdog does not depend on the kernels, and restarts stay quick.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from triton_backend.engine import FinishReason, Request
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.faults import FAULT_FILE_ENV, inject
from triton_backend.engine.cpu.kernels import ENV_SWITCH
from triton_backend.engine.process.executor import ProcessExecutor
from triton_backend.engine.process.watchdog import (MIN_FREEZE_SECONDS, ProgressWatch, Watchdog,
                                                    run_queue_seconds,
                                                    check_freeze_seconds)
from triton_backend.engine.supervision import EngineHealth, RestartPolicy, health_of

from tiny import final_response

DETECTION_BOUND_SECONDS = 10.0  # the issue's: a frozen engine's requests end within 10 s
FREEZE = "made no progress for"


@pytest.fixture(autouse=True)
def torch_paths(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "torch")


def _running(ex: ProcessExecutor, count: int) -> list[int]:
    """`count` long streaming requests, each seen producing tokens."""
    rids = [ex.enqueue_request(Request([5, 6, 7 + i], 200, streaming=True, ignore_eos=True))
            for i in range(count)]
    for rid in rids:
        assert ex.await_responses(rid, timeout=120), f"request {rid} produced nothing"
    return rids


def _finals(ex: ProcessExecutor, rids: list[int], since: float) -> tuple[dict, float]:
    """The final responses of `rids`, and when (seconds after `since`) the last arrived."""
    finals = {rid: final_response(ex, rid, timeout=60) for rid in rids}
    return finals, time.monotonic() - since


def _settled(ex: ProcessExecutor, timeout: float = 60) -> dict:
    """The stats once the (new) engine reports nothing running and no KV block in use."""
    deadline = time.monotonic() + timeout
    while True:
        stats = ex.get_stats()
        idle = (stats["num_active_requests"], stats["num_used_blocks"],
                stats["num_client_requests"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _assert_ended_by_the_freeze(finals: dict, elapsed: float) -> None:
    for rid, final in finals.items():
        assert final.finish_reason == FinishReason.ERROR, (rid, final)
        assert FREEZE in final.error and "frozen or deadlocked" in final.error, final.error
        assert "restarting" in final.error
    assert elapsed < DETECTION_BOUND_SECONDS, f"requests ended {elapsed:.1f} s after the freeze"


def test_a_stopped_engine_is_killed_and_restarted_in_place(tiny_engines):
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=256))
    pid = ex.get_stats()["engine_pid"]
    try:
        probe = Request([9, 10, 11], 8, ignore_eos=True)
        expected = final_response(ex, ex.enqueue_request(probe)).output_token_ids
        rids = _running(ex, 8)
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        finals, elapsed = _finals(ex, rids, stopped)
        _assert_ended_by_the_freeze(finals, elapsed)
        health = ex.health()  # a new process is starting: that takes longer than this
        assert health.state == "restarting" and FREEZE in health.reason, health
        assert ex.get_stats()["engine_restarting"] == 1
        final = final_response(ex, ex.enqueue_request(probe), timeout=300)
        restarted = time.monotonic() - stopped
        assert final.finish_reason == FinishReason.LENGTH
        assert final.output_token_ids == expected  # greedy: the new engine answers as the old
        stats = _settled(ex)
        assert (stats["num_active_requests"], stats["num_used_blocks"],
                stats["num_client_requests"]) == (0, 0, 0)
        assert stats["num_engine_freezes"] == 1 and stats["num_engine_restarts"] == 1
        assert stats["engine_pid"] != pid and stats["engine_restarting"] == 0
        assert ex.health().state == "running" and ex.is_alive()
        print(f"\nSIGSTOP: 8 requests ended {elapsed:.1f} s after it; a new engine answered "
              f"{restarted:.1f} s after it")
    finally:
        _kill_quietly(pid)
        ex.shutdown()


def test_a_loop_thread_hung_inside_a_step_is_detected_the_same_way(tiny_engines, tmp_path,
                                                                   monkeypatch):
    """The process lives and its sender keeps sending heartbeats; only the count stands still."""
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=256))
    pid = ex.get_stats()["engine_pid"]
    try:
        rids = _running(ex, 8)
        inject(fault, "hang")
        injected = time.monotonic()
        finals, elapsed = _finals(ex, rids, injected)
        _assert_ended_by_the_freeze(finals, elapsed)
        final = final_response(ex, ex.enqueue_request(Request([5, 6], 3, ignore_eos=True)),
                               timeout=300)
        assert final.finish_reason == FinishReason.LENGTH and final.num_output_tokens == 3
        stats = _settled(ex)
        assert stats["num_engine_freezes"] == 1 and stats["engine_pid"] != pid
        assert stats["num_used_blocks"] == 0 and stats["num_active_requests"] == 0
        print(f"\nhung loop: 8 requests ended {elapsed:.1f} s after the fault was injected")
    finally:
        _kill_quietly(pid)
        ex.shutdown()


def test_past_the_restart_limit_a_frozen_engine_leaves_the_executor_down(tiny_engines):
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64),
                         restart_policy=RestartPolicy(max_restarts=0, window_seconds=600))
    pid = ex.get_stats()["engine_pid"]
    try:
        (rid,) = _running(ex, 1)
        os.kill(pid, signal.SIGSTOP)
        final = final_response(ex, rid, timeout=DETECTION_BOUND_SECONDS + 30)
        assert final.finish_reason == FinishReason.ERROR and FREEZE in final.error
        assert "restarting" not in final.error  # it is not
        deadline = time.monotonic() + 30
        while ex.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        health = ex.health()
        assert health.state == "down" and not ex.is_alive()
        assert FREEZE in health.reason and "not restarted" in health.reason, health
        assert ex.get_stats()["engine_up"] == 0
        with pytest.raises(RuntimeError, match="shut down .*made no progress"):
            ex.enqueue_request(Request([5], 2))
    finally:
        _kill_quietly(pid)
        ex.shutdown()


def test_a_slow_step_that_keeps_moving_is_not_a_freeze(tiny_engines, tmp_path, monkeypatch):
    """A step three times as long as the freeze limit, advancing the count all along."""
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64),
                         freeze_seconds=MIN_FREEZE_SECONDS)
    try:
        (rid,) = _running(ex, 1)
        inject(fault, f"slow:{3 * MIN_FREEZE_SECONDS}")
        final = final_response(ex, rid, timeout=120)
        assert final.finish_reason == FinishReason.LENGTH
        stats = ex.get_stats()
        assert stats["num_engine_freezes"] == 0 and stats["num_engine_restarts"] == 0
        assert not fault.exists()  # the slow step did run
        assert stats["max_seconds_without_progress"] < MIN_FREEZE_SECONDS
    finally:
        ex.shutdown()


def _deep_engine(tmp) -> "os.PathLike":
    """A random-weight Llama of 48 thin layers taking a 2048-token step: a full prefill lasts
    seconds (longer than the freeze limit below), each layer a small part of it."""
    import torch
    import transformers
    from rich.console import Console

    import tiny
    from builder.pipeline.engine_builder import build_engine
    from builder.spec.load import spec_from_dict

    checkpoint = tmp / "hf-deep"
    tokenizer = tiny.make_tokenizer(checkpoint)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=48,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(checkpoint))
    spec = spec_from_dict({
        "name": "deep", "checkpoint": str(checkpoint), "dtype": "float32",
        "output": str(tmp / "engine-deep"),
        "limits": {"max_batch_size": 4, "max_num_tokens": 2048, "max_input_len": 2048,
                   "max_seq_len": 2304},
        "kv_cache": {"tokens_per_block": 16, "num_blocks": 160}})
    return build_engine(spec, console=Console(quiet=True), emit_repository=False)


@pytest.mark.slow
def test_a_full_prefill_beside_a_busy_process_is_not_a_freeze(tmp_path):
    engine_dir = _deep_engine(tmp_path)
    freeze_seconds = 3.0
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ex = ProcessExecutor(engine_dir, freeze_seconds=freeze_seconds)
    try:
        limits = ex.config.limits
        prompt = [3 + (i * 7) % 300 for i in range(limits.max_num_tokens)]
        started = time.monotonic()
        final = final_response(ex, ex.enqueue_request(Request(prompt, 1, ignore_eos=True)),
                               timeout=600)
        seconds = time.monotonic() - started
        stats = ex.get_stats()
        assert final.finish_reason == FinishReason.LENGTH
        assert stats["num_engine_freezes"] == 0 and stats["num_engine_restarts"] == 0
        assert stats["max_seconds_without_progress"] < freeze_seconds
        print(f"\n{limits.max_num_tokens}-token prefill beside a busy process: {seconds:.1f} s, "
              f"longest wait between two moves of the count "
              f"{stats['max_seconds_without_progress']:.2f} s (freeze limit {freeze_seconds} s)")
    finally:
        neighbour.kill()
        neighbour.wait()
        ex.shutdown()


def test_progress_watch_and_its_limit():
    now = [100.0]
    watch = ProgressWatch(clock=lambda: now[0])
    assert watch.stalled_seconds() is None  # disarmed until an engine is ready
    watch.arm()
    watch.observe(1)
    now[0] += 2.0
    watch.observe(1)  # a heartbeat with the same count: no progress
    assert watch.stalled_seconds() == 2.0
    watch.observe(2)
    assert watch.stalled_seconds() == 0.0 and watch.longest_gap == 2.0
    now[0] += 1.0
    watch.observe(None)  # an engine without a count: any message is progress
    assert watch.stalled_seconds() == 0.0
    watch.disarm()
    assert watch.stalled_seconds() is None
    assert check_freeze_seconds(None) is None and check_freeze_seconds(5) == 5.0
    for bad in (0, 0.5, -1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="engine_freeze_seconds must be a number >= 1"):
            check_freeze_seconds(bad)


def test_time_spent_waiting_for_a_cpu_is_no_freeze():
    """The watchdog on a real clock: a stall whose engine waits for a CPU as long as it stalls
    (an overloaded machine) never fires; the same stall with no run-queue time (stopped,
    deadlocked) fires after the limit."""
    def fires(starved) -> float | None:
        watch, fired = ProgressWatch(), []
        watch.arm()
        dog = Watchdog(watch, 1.0, fired.append, starved=starved)
        start = time.monotonic()
        dog.start()
        try:
            while not fired and time.monotonic() - start < 3.0:
                time.sleep(0.05)
        finally:
            dog.stop()
        return fired[0] if fired else None

    assert fires(time.monotonic) is None  # starved for every second of the stall
    stalled = fires(lambda: 0.0)
    assert stalled is not None and 1.0 <= stalled < 2.0
    assert fires(lambda: None) is not None  # unknown run-queue time: every second counts
    assert run_queue_seconds(os.getpid()) >= 0.0  # this Linux reports it
    assert run_queue_seconds(2 ** 22 + 1) is None  # no such process


def test_executors_without_a_health_verb_are_running_or_down():
    class Looping:
        def __init__(self, alive, reason=""):
            self.alive, self.down_reason = alive, reason

        def is_alive(self):
            return self.alive

    assert health_of(Looping(True)) == EngineHealth("running")
    assert health_of(Looping(False, "2 crashes")) == EngineHealth("down", "2 crashes")
    assert health_of(Looping(False)) == EngineHealth("down", "stopped")

"""The engine process: where the engine runs, what happens when it dies or its client goes away."""
import os
import signal
import subprocess
import sys
import time

import pytest

from triton_backend.engine import FinishReason, Request
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.process.executor import EngineProcessError, ProcessExecutor

from tiny import final_response

CLIENT = """
import time
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.process.executor import ProcessExecutor
ex = ProcessExecutor({engine!r}, EngineOptions(kv_cache_num_blocks=64))
print(ex.get_stats()["engine_pid"], flush=True)
time.sleep(600)
"""


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_engine_runs_in_its_own_process_with_the_threads_asked_for(tiny_engines):
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64), num_threads=1)
    try:
        stats = ex.get_stats()
        assert stats["engine_pid"] != os.getpid()
        assert stats["num_threads"] == 1 and stats["num_total_blocks"] == 64
        rid = ex.enqueue_request(Request([5, 6, 7], 4, ignore_eos=True))
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.LENGTH and len(final.output_token_ids) == 4
    finally:
        ex.shutdown()
    assert _wait_gone(stats["engine_pid"])


def test_a_killed_engine_ends_requests_in_flight_with_an_error(tiny_engines):
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=128))
    try:
        rid = ex.enqueue_request(Request([5, 6, 7], 240, streaming=True, ignore_eos=True))
        assert ex.await_responses(rid, timeout=30)  # it is running
        os.kill(ex.get_stats()["engine_pid"], signal.SIGKILL)
        final = final_response(ex, rid)
        assert final.finish_reason == FinishReason.ERROR
        assert "engine process was killed by SIGKILL (exit code -9)" in final.error
        # A new engine process is started in place and serves the next request.
        rid = ex.enqueue_request(Request([5, 6], 3, ignore_eos=True))
        final = final_response(ex, rid, timeout=300)
        assert final.finish_reason == FinishReason.LENGTH and len(final.output_token_ids) == 3
        stats = ex.get_stats()
        assert stats["num_engine_restarts"] == 1 and ex.is_alive()
    finally:
        ex.shutdown()


def test_an_engine_that_keeps_dying_is_down_after_the_crash_loop_limit(tiny_engines):
    from triton_backend.engine.supervision import RestartPolicy

    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64),
                         restart_policy=RestartPolicy(max_restarts=1, window_seconds=600))
    try:
        for _ in range(2):
            pid = ex.get_stats()["engine_pid"]
            os.kill(pid, signal.SIGKILL)
            assert _wait_gone(pid)
            deadline = time.monotonic() + 120
            while ex.is_alive() and ex.get_stats()["engine_pid"] == pid \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
        deadline = time.monotonic() + 30
        while ex.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ex.is_alive()
        assert "not restarted" in ex.down_reason
        with pytest.raises(RuntimeError, match="shut down .*2 crashes within 600 s"):
            ex.enqueue_request(Request([5], 2))
    finally:
        ex.shutdown()


def _engine_processes() -> set[int]:
    """This process's engine processes (children running the engine's main module)."""
    found = set()
    for pid in _children(os.getpid()):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"triton_backend.engine.process.main" in cmdline:
            found.add(pid)
    return found


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (the executor's own thread starts new engines)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found += [int(child) for child in listing.read().split()]
        except OSError:
            pass
    return found


def _kill_while_starting(old: set[int], timeout: float = 60.0) -> int:
    """SIGKILL the engine process started after `old`, as soon as it exists (before ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = _engine_processes() - old
        if new:
            pid = new.pop()
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.02)
    raise AssertionError("no new engine process was started")


def test_an_engine_killed_again_while_restarting_is_started_again(tiny_engines):
    """Three kills in a row, two of them of an engine still starting: each counts as a crash,
    a new engine is started each time within the restart policy, and the executor serves again
    soon after the last kill; what it reports names the kill."""
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64))
    try:
        killed = {ex.get_stats()["engine_pid"]}
        os.kill(next(iter(killed)), signal.SIGKILL)
        causes = []
        for _ in range(2):
            killed.add(_kill_while_starting(killed))
            causes.append(ex.health().reason)
        last_kill = time.monotonic()
        assert all("killed by SIGKILL (exit code -9)" in cause for cause in causes), causes
        rid = ex.enqueue_request(Request([5, 6], 3, ignore_eos=True))
        final = final_response(ex, rid, timeout=60)
        back = time.monotonic() - last_kill
        assert final.finish_reason == FinishReason.LENGTH, final
        assert ex.is_alive() and ex.health().state == "running"
        assert ex.get_stats()["num_engine_restarts"] == 3
        assert back < 15.0, back
        print(f"\nthree kills, two while starting: serving again {back:.1f} s after the last")
    finally:
        ex.shutdown()


def test_an_engine_killed_while_starting_past_the_policy_is_down_naming_the_kill(tiny_engines):
    from triton_backend.engine.supervision import RestartPolicy

    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64),
                         restart_policy=RestartPolicy(max_restarts=1, window_seconds=600))
    try:
        first = ex.get_stats()["engine_pid"]
        os.kill(first, signal.SIGKILL)
        _kill_while_starting({first})
        deadline = time.monotonic() + 60
        while ex.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ex.is_alive()
        assert "was killed by SIGKILL (exit code -9) while starting" in ex.down_reason
        assert "did not start within" not in ex.down_reason
    finally:
        ex.shutdown()


def test_the_load_gauges_drop_to_zero_when_a_dead_engines_requests_end(tiny_engines):
    """A router reads running requests and used KV blocks: once the engine is dead and its
    requests have ended, they say so while the new engine starts, not the dead one's last."""
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=128))
    try:
        ids = [ex.enqueue_request(Request([5, 6, 7, 8], 200, streaming=True, ignore_eos=True))
               for _ in range(4)]
        deadline = time.monotonic() + 60
        while ex.get_stats()["num_active_requests"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = ex.get_stats()
        assert before["num_active_requests"] == 4 and before["num_used_blocks"] > 0, before
        os.kill(before["engine_pid"], signal.SIGKILL)
        for rid in ids:
            assert final_response(ex, rid).finish_reason == FinishReason.ERROR
        stats = ex.get_stats()
        assert stats["engine_restarting"] == 1, stats  # the new engine is not up yet
        assert (stats["num_active_requests"], stats["num_waiting_requests"],
                stats["num_used_blocks"], stats["num_client_requests"]) == (0, 0, 0, 0), stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"] == 128
    finally:
        ex.shutdown()


def test_the_engine_exits_when_its_client_is_killed(tiny_engines):
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT.format(engine=str(tiny_engines("llama_gqa")))],
        stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        pid = int(client.stdout.readline())
    finally:
        client.kill()  # as the OOM killer would: no shutdown, no goodbye
        client.wait(timeout=30)
    assert _wait_gone(pid), "the engine process outlived its client"


def test_a_broken_engine_directory_fails_at_start_with_the_reason(tmp_path, tiny_engines):
    engine = tiny_engines("llama_gqa")
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in engine.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).symlink_to(item)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EngineProcessError, match="failed to start"):
        ProcessExecutor(broken, EngineOptions(kv_cache_num_blocks=64))


def test_the_engine_process_reports_the_options_it_was_built_with(tiny_engines):
    from test_engine_options import NON_DEFAULT

    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(**NON_DEFAULT), num_threads=1)
    try:
        assert ex.info["options"] == EngineOptions(**NON_DEFAULT)
        assert ex.get_stats()["num_total_blocks"] == NON_DEFAULT["kv_cache_num_blocks"]
    finally:
        ex.shutdown()


def test_a_caller_may_choose_the_request_id_as_with_the_in_process_executor(tiny_engines):
    ex = ProcessExecutor(tiny_engines("llama_gqa"), EngineOptions(kv_cache_num_blocks=64), num_threads=1)
    try:
        assert ex.enqueue_request(Request([5, 6, 7], 2, ignore_eos=True), request_id=77) == 77
        assert final_response(ex, 77).request_id == 77
    finally:
        ex.shutdown()

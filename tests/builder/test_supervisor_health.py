"""The supervisor's decisions as forge serve's probes see them, on scripted probe answers (no
server): an engine restarting in place is left alone up to the restart limit and shows as alive
but not ready; past the limit it is reloaded; a reload and giving up reach `HealthState`."""
import json
import threading

import pytest

import builder.serving.supervisor as supervisor_module
from builder.serving.health import HealthState
from builder.serving.supervisor import ProbeResult, Supervisor, probe_model
from triton_backend.models.serving_control import ENGINE_DOWN, ENGINE_RESTARTING

RESTARTING = ENGINE_RESTARTING.format(reason="the engine process froze for 10 s")


class ScriptedTriton:
    """Each probe takes the next answer of `script` (the last one repeats) and advances the
    clock by `step` seconds; repository calls are recorded."""

    def __init__(self, monkeypatch, script: list[tuple[int, str]], step: float = 1.0):
        self.script, self.step, self.now = list(script), step, 0.0
        self.calls: list[str] = []
        self.probes = 0
        self.done = threading.Event()
        monkeypatch.setattr(supervisor_module, "_post", self.answer)
        monkeypatch.setattr(supervisor_module, "unload_model",
                            lambda url, model: self.calls.append(f"{model}/unload"))
        monkeypatch.setattr(supervisor_module, "load_model",
                            lambda url, model, timeout: self.calls.append(f"{model}/load"))
        monkeypatch.setattr(supervisor_module, "mark_not_ready",
                            lambda url, reason: self.calls.append("not ready"))

    def clock(self) -> float:
        return self.now

    def answer(self, url, body, timeout) -> tuple[int, str]:
        """Triton's answer to the probe (the real `probe_model` reads it)."""
        status, message = self.script[min(self.probes, len(self.script) - 1)]
        self.probes += 1
        self.now += self.step
        if self.probes >= len(self.script):
            self.done.set()
        return status, json.dumps({"error": message} if message else {})

    def supervise(self, health: HealthState, **kwargs) -> Supervisor:
        kwargs = {"period": 0.001, "restart_seconds": 60.0, "max_reloads": 1, **kwargs}
        return Supervisor("fake:1", health=health, report=lambda line: None,
                          clock=self.clock, **kwargs)


def test_the_restarting_answer_reads_as_alive_not_ready(monkeypatch):
    triton = ScriptedTriton(monkeypatch, [(400, RESTARTING), (400, ENGINE_DOWN.format(
        reason="4 crashes")), (400, "Exceeds maximum queue size")])
    assert probe_model("fake:1") == ProbeResult(None, RESTARTING, restarting=True)
    assert probe_model("fake:1") == ProbeResult(False, "tensorrt_llm: the engine is down "
                                                       "(4 crashes)")
    assert probe_model("fake:1") == ProbeResult(None, "Exceeds maximum queue size")
    assert triton.probes == 3


@pytest.mark.parametrize("restarting_probes, reloads", [(50, 0), (70, 1)])
def test_an_engine_restarting_in_place_is_left_alone_up_to_the_restart_limit(
        monkeypatch, restarting_probes, reloads):
    """50 s of "restarting" (one probe a second) then serving: no reload; 70 s: one reload at
    60 s. Readiness is off and liveness on meanwhile."""
    triton = ScriptedTriton(monkeypatch, [(200, "")] + [(400, RESTARTING)] * restarting_probes
                            + [(200, "")] * 3)
    health = HealthState(clock=triton.clock)
    health.mark_started()
    seen: list[tuple[bool, bool]] = []
    original = health.restarting

    def record(model, reason):
        original(model, reason)
        seen.append((health.readiness().ok, health.liveness().ok))

    health.restarting = record
    supervisor = triton.supervise(health)
    supervisor.start()
    try:
        assert triton.done.wait(30)
    finally:
        supervisor.stop()
    assert triton.calls == ["tensorrt_llm/unload", "tensorrt_llm/load"] * reloads
    assert seen and set(seen) == {(False, True)}
    assert health.readiness().ok and health.liveness().ok


def test_an_engine_down_with_no_reloads_left_fails_both_probes(monkeypatch):
    triton = ScriptedTriton(monkeypatch, [(200, ""), (400, ENGINE_DOWN.format(reason="4 crashes"))])
    health = HealthState(clock=triton.clock)
    health.mark_started()
    supervisor = triton.supervise(health, max_reloads=0)
    supervisor.start()
    supervisor.join(30)
    assert supervisor.gave_up.is_set() and not supervisor.is_alive()
    assert triton.calls == ["tensorrt_llm/unload", "not ready"]
    assert (health.readiness().status, health.liveness().status) == ("gave_up", "gave_up")
    assert "tensorrt_llm: the engine is down (4 crashes)" in health.liveness().reason


def test_a_reload_shows_unloaded_then_serving(monkeypatch):
    triton = ScriptedTriton(monkeypatch, [(200, ""), (400, "Stub process 'x' is not healthy.")]
                            + [(200, "")] * 3)
    health = HealthState(clock=triton.clock)
    health.mark_started()
    states: list[str] = []
    monkeypatch.setattr(supervisor_module, "load_model", lambda url, model, timeout: (
        states.append(health.readiness().status), triton.calls.append(f"{model}/load"))[-1])
    supervisor = triton.supervise(health, max_reloads=3)
    supervisor.start()
    try:
        assert triton.done.wait(30)
    finally:
        supervisor.stop()
    assert states == ["unloaded"]  # while it reloads
    assert triton.calls == ["tensorrt_llm/unload", "tensorrt_llm/load"]
    assert health.readiness().ok and health.liveness().ok

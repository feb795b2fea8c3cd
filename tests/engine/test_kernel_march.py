"""Kernels built for a named x86-64 level (what the CPU image carries): one library for every CPU
that has the level, plans still measured per CPU, and a CPU without the level refused."""
import platform

from triton_backend.engine.cpu import kernels

AVX2_EPYC = ("model name: AMD EPYC\nflags: cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 "
             "bmi2 f16c fma abm movbe xsave")
AVX512_XEON = AVX2_EPYC.replace("AMD EPYC", "Intel Xeon") + " avx512f avx512bw avx512cd avx512dq avx512vl"
OLD_ATOM = "model name: Intel Atom\nflags: cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"


def _keys(monkeypatch, signature: str) -> tuple[str, str]:
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: signature)
    return kernels.build_key(), kernels.plan_key()


def test_a_named_level_builds_one_library_for_every_cpu_and_plans_per_cpu(monkeypatch):
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3")
    build_epyc, plan_epyc = _keys(monkeypatch, AVX2_EPYC)
    build_xeon, plan_xeon = _keys(monkeypatch, AVX512_XEON)
    assert build_epyc == build_xeon  # the library compiled into an image serves both
    assert plan_epyc != plan_xeon and plan_epyc.startswith(build_epyc)


def test_a_native_build_is_its_cpus_own(monkeypatch):
    monkeypatch.delenv(kernels.MARCH_ENV, raising=False)
    build_epyc, plan_epyc = _keys(monkeypatch, AVX2_EPYC)
    build_xeon, _ = _keys(monkeypatch, AVX512_XEON)
    assert build_epyc != build_xeon
    assert plan_epyc == build_epyc  # the key already names the CPU, so cached plans stay where they were


def test_the_flags_each_level_needs():
    flags = set(AVX2_EPYC.split("flags: ")[1].split())
    assert kernels.missing_cpu_flags("x86-64-v3", flags) == []
    assert kernels.missing_cpu_flags("x86-64-v4", flags) == [
        "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
    assert kernels.missing_cpu_flags("native", set()) == []


def test_a_cpu_without_the_level_gets_the_torch_paths_without_building(monkeypatch, tmp_path):
    """An AVX-512 image on an AVX2-only node, or an AVX2 one on an older CPU: the library would
    die on its first illegal instruction; the engine is told why and serves with torch."""
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v4")
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: AVX2_EPYC)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    said = []
    assert kernels.load_cpu_kernels(said.append) is False
    assert said == ["CPU kernels: built for x86-64-v4 (LLM_FORGE_KERNEL_MARCH), which this CPU "
                    "lacks (avx512f, avx512bw, avx512cd, avx512dq, avx512vl); using the "
                    "pure-torch paths"]
    assert not (tmp_path / "kernels").exists()  # nothing compiled
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3")
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: OLD_ATOM)
    assert kernels.load_cpu_kernels(said.append) is False
    assert "lacks (avx, avx2, bmi1, bmi2, f16c, fma, abm, movbe, xsave)" in said[-1]


def test_kernels_switched_off_for_a_while_come_back_when_the_switch_does(monkeypatch):
    """A calibration run (FP8 activation scales, `rounding: activation`) sets the switch to
    torch for its own engine; the quality gate's engine after it, in the same process, gets the
    kernels again (an int8 LM head needs them)."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.ENV_SWITCH, "torch")
    assert kernels.load_cpu_kernels() is False
    monkeypatch.delenv(kernels.ENV_SWITCH)
    if platform.machine() != "x86_64":
        return
    assert kernels.load_cpu_kernels() is True
    monkeypatch.setenv(kernels.ENV_SWITCH, "torch")
    assert kernels.load_cpu_kernels() is False  # a load already made is not used while off

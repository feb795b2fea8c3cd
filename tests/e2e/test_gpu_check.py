"""`make gpu-check DEVICE=cpu`: the GPU check's every step on small shapes, the GPU backend's
step on this CPU (parity with transformers with graphs' buffers and without, a prefix-cache hit,
FP8 built and gated, forge serve answering through the OpenAI endpoint); one JSON, one table."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_gpu_check_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    run = subprocess.run(["make", "-s", "gpu-check", "DEVICE=cpu", f"GPU_CHECK_OUT={out}",
                          f"GPU_CHECK_WORK={tmp_path / 'work'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800,
                         env={k: v for k, v in os.environ.items() if k != "LLM_FORGE_KERNELS"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["passed"]
    applied = {c["name"]: c for c in report["checks"] if c["applied"]}
    for shape in ("smollm2-shape-tiny", "llama-shape-tiny"):
        for mode in ("graphs", "eager"):
            assert applied[f"{shape} greedy ids = transformers ({mode})"]["passed"]
        assert report["shapes"][shape]["parity"]["graphs"]["graph_replays"] > 0
        assert report["shapes"][shape]["parity"]["graphs"]["ops"] == "gpu"
        assert applied[f"{shape} prefill top-1 = transformers"]["passed"]
    assert applied["llama-shape-tiny FP8 gate"]["passed"]
    assert report["fp8"]["speedup"] > 0
    assert applied["served: the OpenAI demo request answered"]["passed"]
    assert report["served"]["tok_s"] > 0
    assert "gpu-check on" in run.stdout and "report:" in run.stdout  # the one table
    assert "AMD" in report["machine"]["cpu"] or "Intel" in report["machine"]["cpu"]

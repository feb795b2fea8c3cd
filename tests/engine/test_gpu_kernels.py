"""The GPU backend's Triton kernels, run by Triton's interpreter on this CPU against their torch
references (paged attention: decodes, prefill chunks over a cached prefix, GQA groups of 3 and 4,
head sizes that are not a power of two, split keys merged, bf16, int8 and FP8 caches).

Triton is installed by `make setup` into a folder of its own (`.venv/triton`), outside the
virtual environment's path, so only the process this test starts imports it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = Path(os.environ.get("LLM_FORGE_TRITON_DIR", ROOT / ".venv" / "triton"))


def test_kernels_match_their_references_under_the_interpreter():
    assert (TRITON_DIR / "triton").is_dir(), (
        f"Triton is not installed in {TRITON_DIR}: `make setup` installs it there")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(ROOT)]))
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "gpu_kernel_checks.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("max |kernel - reference|") == 8, run.stdout

"""The GPU backend's Triton kernels, run by Triton's interpreter on this CPU against their torch
references (paged attention: decodes, prompts' first chunks packed, prefill chunks over a cached
prefix, keys as computed in one-token blocks, GQA groups of 3 and 4,
head sizes that are not a power of two, split keys merged, bf16, int8 and FP8 caches; the fused
RMSNorm with its residual add, SiLU * up, and rotary with the KV-cache write in each cache
format, against the torch ops).

Triton is installed by `make setup` into a folder of its own (`.venv/triton`), outside the
virtual environment's path, so only the process this test starts imports it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = Path(os.environ.get("LLM_FORGE_TRITON_DIR", ROOT / ".venv" / "triton"))


def _interpreted(*args: str) -> subprocess.CompletedProcess:
    return _interpreted_script("gpu_kernel_checks.py", *args)


def _interpreted_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run tests/engine/`script` in a process of its own under Triton's interpreter."""
    assert (TRITON_DIR / "triton").is_dir(), (
        f"Triton is not installed in {TRITON_DIR}: `make setup` installs it there")
    env = dict(os.environ, TRITON_INTERPRET="1", LLM_FORGE_KERNELS="gpu",
               PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(ROOT)]))
    return subprocess.run([sys.executable, str(Path(__file__).parent / script), *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_kernels_match_their_references_under_the_interpreter():
    run = _interpreted()
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("max |kernel - reference|") == 13, run.stdout
    assert run.stdout.count("from the torch op") == 16 + 5, run.stdout  # gpu-check's own 5


def test_the_engine_with_every_gpu_kernel_matches_transformers(tiny_engines, tmp_path):
    """The whole GPU backend, its kernels interpreted on the CPU, inside the engine: greedy ids
    against transformers (a Llama, and a Gemma 3 whose prompts run past its local layers'
    window); and over an int8 cache with n-gram drafts, the kernels' tokens equal their
    references'."""
    import tiny
    from test_speculative import speculative_engine

    base = tiny_engines("llama_gqa")
    int8 = tiny.one_byte_kv_engine(base, tmp_path, "int8")
    variant = speculative_engine(int8, tmp_path, mode="ngram", num_draft_tokens=3,
                                 prompt_lookup_min=1)
    run = _interpreted(str(base), str(variant), str(tiny_engines("family:gemma3")))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("transformers:") == 6, run.stdout
    assert run.stdout.count("kernels ") == 2 and "drafts 0" not in run.stdout, run.stdout


def test_the_bf16_tensor_core_branches_match_the_reference():
    """The paged kernel's 16-bit `tl.dot` branches (decodes, chunks over a prefix, GQA 3 and 4,
    split keys, an FP8 cache widened to bf16) under the interpreter, its bf16 dots emulated as a
    tensor core computes them (exact products, float32 sums), within bf16 tolerance."""
    run = _interpreted_script("gpu_bf16_dot_checks.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("bf16 dot") == 4, run.stdout


def test_fp8_activations_take_one_launch_per_projection_in_a_decode_step(tmp_path):
    """A bf16 decode step with FP8 projections on `_scaled_mm`: quantizing each input by the
    torch ops (widen, divide, clamp, narrow) launches four kernels, the fused kernel one."""
    import re

    import tiny

    engine_dir = tiny.build_engine(tmp_path, "llama_gqa", dtype="bfloat16")
    run = _interpreted_script("gpu_launch_checks.py", str(engine_dir))
    assert run.returncode == 0, run.stdout + run.stderr
    projections, layers = map(int, re.search(r"fp8 projections (\d+), layers (\d+)",
                                             run.stdout).groups())
    assert projections == 4 * layers == 8
    before, after = map(int, re.search(r"decode step launches: before (\d+) after (\d+)",
                                       run.stdout).groups())
    assert after == before - 3 * projections, run.stdout
    torch_before, triton_before = re.search(r"before: torch (\{.*\}) triton (\d+)",
                                            run.stdout).groups()
    torch_after, triton_after = re.search(r"after: torch (\{.*\}) triton (\d+)",
                                          run.stdout).groups()
    assert int(triton_after) == int(triton_before) + projections
    assert "'div': 8" in torch_before and "'clamp': 8" in torch_before
    assert "div" not in torch_after and "clamp" not in torch_after

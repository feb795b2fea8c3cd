"""The GPU room's fused mixture-of-experts kernels under Triton's interpreter, against the
runtime's SparseMoE: the grouping of (token, expert) pairs on the device, decodes and prefill
chunks, SiLU and GELU-tanh, renormalised or not, float32 and bf16."""
from test_gpu_kernels import _interpreted_script


def test_fused_moe_matches_the_torch_experts_under_the_interpreter():
    run = _interpreted_script("gpu_moe_checks.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "alignment: every pair once" in run.stdout, run.stdout
    assert run.stdout.count("max |kernel - reference|") == 4, run.stdout


def test_a_mixture_of_experts_engine_on_the_fused_kernels_matches_transformers(tmp_path):
    import tiny

    engine = tiny.build_engine(tmp_path, "family:mixtral")
    run = _interpreted_script("gpu_moe_checks.py", str(engine))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "greedy equal to transformers for 2 prompts" in run.stdout, run.stdout

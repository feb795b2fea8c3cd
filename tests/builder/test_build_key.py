"""CI rebuilds: the build key skips an unchanged engine and names what changed; toolchain refusal."""
import json
import time

import pytest
from click.testing import CliRunner

import builder
import tiny
from builder.cli import main
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.toolchain import ToolchainMismatch


def forge(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("key")
    checkpoint = tiny.make_checkpoint(tmp / "hf", "llama_gqa")
    spec = tmp / "spec.yaml"
    spec.write_text(f"name: keyed\ncheckpoint: {checkpoint}\ndtype: float32\n"
                    f"output: {tmp / 'engine'}\nlimits: {{max_batch_size: 4, max_num_tokens: 64, "
                    f"max_input_len: 32, max_seq_len: 64}}\n")
    first = forge("engine", "--spec", spec, "--no-repository")
    assert first.exit_code == 0, first.output + first.stderr
    return spec, checkpoint, tmp / "engine"


def test_second_run_skips_fast_and_check_says_up_to_date(built):
    spec, _, engine = built
    start = time.perf_counter()
    again = forge("engine", "--spec", spec, "--no-repository")
    assert time.perf_counter() - start < 3.0
    assert again.exit_code == 0 and "up to date" in again.stderr
    assert forge("engine", "--spec", spec, "--check").exit_code == 0
    stamp = (engine / "config.json").stat().st_mtime_ns
    forced = forge("engine", "--spec", spec, "--no-repository", "--force")
    assert forced.exit_code == 0 and (engine / "config.json").stat().st_mtime_ns != stamp


def test_a_spec_value_triggers_a_rebuild(built):
    spec, _, _ = built
    check = forge("engine", "--spec", spec, "--check", "--name", "renamed")
    assert check.exit_code == 4 and "spec name: keyed -> renamed" in check.stderr
    dtype = forge("engine", "--spec", spec, "--check", "--dtype", "bfloat16")
    assert dtype.exit_code == 4 and "spec dtype: float32 -> bfloat16" in dtype.stderr


def test_one_checkpoint_byte_triggers_a_rebuild(built, tmp_path):
    import shutil

    spec, checkpoint, _ = built
    copy = tmp_path / "hf"
    shutil.copytree(checkpoint, copy)
    changed = forge("engine", "--spec", spec, "--check", "--checkpoint", copy)
    assert changed.exit_code == 4 and "spec checkpoint:" in changed.stderr  # another source
    original = forge("engine", "--spec", spec, "--check")
    assert original.exit_code == 0
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    try:
        flipped = forge("engine", "--spec", spec, "--check")
        assert flipped.exit_code == 4
        assert "checkpoint file model.safetensors changed" in flipped.stderr
    finally:
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
    assert forge("engine", "--spec", spec, "--check").exit_code == 0


def test_the_llm_forge_version_triggers_a_rebuild(built, monkeypatch):
    spec, _, _ = built
    monkeypatch.setattr(builder, "__version__", "9.9.9")
    check = forge("engine", "--spec", spec, "--check")
    assert check.exit_code == 4 and "llm-forge version: 0.1.0 -> 9.9.9" in check.stderr


def test_missing_engine_is_stale(tmp_path):
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    check = forge("engine", "--checkpoint", checkpoint, "--output", tmp_path / "none", "--check")
    assert check.exit_code == 4 and "no engine at" in check.stderr


def test_engine_of_another_toolchain_is_refused_naming_both_versions(built, tmp_path):
    import shutil

    _, _, engine = built
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    here = manifest["toolchain"]["llm-forge"]
    manifest["toolchain"]["llm-forge"] = "0.0.1"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ToolchainMismatch) as err:
        EngineConfig.load(copy)
    assert f"llm-forge: built with 0.0.1, this machine has {here}" in str(err.value)
    result = forge("generate", "--engine", copy, "--prompt-ids", "1,2", "--max-tokens", 2)
    assert result.exit_code == 2 and "built with 0.0.1" in result.stderr


def test_trtllm_engine_needs_the_same_tensorrt_llm_and_gpu(monkeypatch, tmp_path):
    from triton_backend.engine import toolchain

    recorded = {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48", "gpu_sm": 90, "cuda": "13.0"}
    here = {**recorded, "tensorrt_llm": "1.2.0", "gpu_sm": 89}
    found = toolchain.mismatches(recorded, here, "trtllm")
    assert found == ["tensorrt_llm: built with 1.2.1, this machine has 1.2.0",
                     "gpu_sm: built with 90, this machine has 89"]
    # A CPU machine without TensorRT-LLM knows none of them: nothing to compare, no refusal.
    assert toolchain.mismatches(recorded, {"tensorrt_llm": None, "gpu_sm": None}, "trtllm") == []
    (tmp_path / "manifest.json").write_text(json.dumps({"toolchain": recorded}))
    monkeypatch.setattr(toolchain, "current_toolchain", lambda target: here)
    with pytest.raises(ToolchainMismatch, match="tensorrt_llm: built with 1.2.1"):
        toolchain.check_toolchain(tmp_path, "trtllm")


def test_a_variant_build_never_repoints_a_repository_serving_another_engine(built, tmp_path):
    """A variant built elsewhere under the same spec name must not take over the repository
    that serves the engine: refused (exit 2, naming both, nothing built), unless --force."""
    from builder.repository.target import served_engine

    spec, _, engine = built
    repository = tmp_path / "repository"
    first = forge("engine", "--spec", spec, "--repository", repository)
    assert first.exit_code == 0, first.output
    assert served_engine(repository) == engine.resolve()
    variant = tmp_path / "variants" / "fp32-copy"
    refused = forge("engine", "--spec", spec, "--output", variant, "--repository", repository)
    assert refused.exit_code == 2
    assert (f"error: repository {repository} serves the engine {engine.resolve()}, not {variant}: "
            "it is not rewritten without --force") in refused.stderr
    assert not variant.exists() and served_engine(repository) == engine.resolve()
    assert forge("engine", "--spec", spec, "--repository", repository, "--check").exit_code == 0

    forced = forge("engine", "--spec", spec, "--output", variant, "--repository", repository,
                   "--force")
    assert forced.exit_code == 0, forced.output
    assert served_engine(repository) == variant.resolve()
    from builder.cli.serve import served_engine_line

    assert served_engine_line(repository) == (f"  engine   {variant.resolve()} (torch, float32, "
                                              "weights none, KV cache none): tensorrt_llm, "
                                              "ensemble, BLS")
    # The engine's build key still holds, but the repository it promised serves the variant.
    stale = forge("engine", "--spec", spec, "--repository", repository, "--check")
    assert stale.exit_code == 4
    assert (f"rebuild needed: repository {repository} serves the engine {variant.resolve()}, "
            f"not {engine}") in stale.stderr

"""Engines and repositories are built aside and swapped in; nothing llm-forge did not write is
deleted; a rejected engine never replaces a good one; config.pbtxt values are escaped."""
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import tiny
from builder.pipeline import engine_builder
from builder.errors import QualityGateError
from builder.pipeline.install import check_replaceable, swap_in
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.repository.template import render


def test_output_over_a_directory_of_other_engines_is_refused_and_nothing_deleted(tmp_path):
    engines = tmp_path / "engines"
    (engines / "other-engine").mkdir(parents=True)
    (engines / "other-engine" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not an llm-forge engine .*refusing to replace"):
        tiny.build_engine(tmp_path, output=str(engines))
    assert (engines / "other-engine" / "weights.bin").read_bytes() == b"x"
    assert not list(tmp_path.glob(".*partial*"))


def test_a_rejected_engine_leaves_the_previous_one_in_place(tmp_path, monkeypatch):
    engine_dir = tiny.build_engine(tmp_path)
    before = (engine_dir / "manifest.json").read_text()

    def fail(*args, **kwargs):
        raise QualityGateError("logits check: injected failure")

    monkeypatch.setattr(engine_builder, "check_against_transformers", fail)
    with pytest.raises(QualityGateError, match="injected failure"):
        tiny.build_engine(tmp_path)
    assert (engine_dir / "manifest.json").read_text() == before
    assert (engine_dir / "model.safetensors").is_file() or any(engine_dir.glob("*.safetensors"))
    assert not list(tmp_path.glob(".*partial*"))


def test_check_replaceable_and_swap_in(tmp_path):
    check_replaceable(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_replaceable(tmp_path / "file")
    new, target = tmp_path / "new", tmp_path / "target"
    new.mkdir(), target.mkdir()
    (new / "a").write_text("new"), (target / "a").write_text("old")
    swap_in(new, target)
    assert (target / "a").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "target"]


def test_values_in_config_pbtxt_are_escaped():
    template = ('name: "m"\nparameters { key: "engine_dir" value: { string_value: '
                '"${engine_dir}" } }\n')
    nasty = 'dir with "quotes" \\ and\nnewline'
    text = render(template, {"engine_dir": nasty})
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.parameters["engine_dir"].string_value == nasty


def test_repository_is_swapped_in_and_keeps_other_files(tmp_path, tiny_engines):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "my_model").mkdir()
    (out / "my_model" / "keep.txt").write_text("mine")
    emit_repository(tiny_engines("llama_gqa"), out, RepositoryOptions())
    first = (out / "tensorrt_llm" / "config.pbtxt").read_text()
    emit_repository(tiny_engines("llama_gqa"), out, RepositoryOptions(stats_period_ms=250))
    second = (out / "tensorrt_llm" / "config.pbtxt").read_text()
    assert first != second and '"250"' in second
    assert (out / "my_model" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["my_model", "ensemble", "preprocessing", "postprocessing", "tensorrt_llm",
         "tensorrt_llm_bls"])
    for model in ("ensemble", "tensorrt_llm"):
        text_format.Parse((out / model / "config.pbtxt").read_text(),
                          model_config_pb2.ModelConfig())


def test_tritonserver_exit_timeout_follows_the_drain_setting(tmp_path):
    from builder.serving.serve import TritonInstall, server_command

    install = TritonInstall(binary=tmp_path / "tritonserver")
    cmd = server_command(install, tmp_path, (1, 2, 3), None, drain_timeout=12.5)
    assert "--exit-timeout-secs=43" in cmd  # the drain, then 30 s to unload the models
    assert "--exit-timeout-secs=60" in server_command(install, tmp_path, (1, 2, 3), None)
    # explicit model control, every model loaded at start: the supervisor may reload one
    assert "--model-control-mode=explicit" in cmd and "--load-model=*" in cmd
    with pytest.raises(ValueError, match=r"drain timeout must be a number of seconds in \[0, 3600\]"):
        server_command(install, tmp_path, (1, 2, 3), None, drain_timeout=-1)

"""The repository emitter: options validation, portable paths, no placeholder left anywhere."""
import json
from pathlib import Path

import pytest

from builder.repository.emit import (MODELS, SHIM_TEMPLATE, TEMPLATES_DIR, RepositoryOptions,
                                emit_repository, portable_path, template_values)
from builder.repository.template import placeholders
from triton_backend.engine.config import EngineConfig, Limits, ModelShape


def make_engine_dir(path: Path) -> Path:
    shape = ModelShape(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, max_position_embeddings=256)
    path.mkdir(parents=True)
    EngineConfig(name="t", target="torch", dtype="float32", model=shape,
                 limits=Limits(max_batch_size=8, max_input_len=64, max_seq_len=128)).save(path)
    return path


def test_every_template_value_is_used_and_every_placeholder_has_a_value(tmp_path):
    engine = make_engine_dir(tmp_path / "engines" / "t")
    values = template_values(EngineConfig.load(engine), engine, tmp_path / "repo",
                             RepositoryOptions())
    used = set()
    for path in TEMPLATES_DIR.rglob("*"):
        if path.is_file() and path.name != SHIM_TEMPLATE:
            used |= placeholders(path.read_text())
    assert used == set(values)
    assert placeholders((TEMPLATES_DIR / SHIM_TEMPLATE).read_text()) == {"model_name", "module",
                                                                         "class_name"}


def test_emit_writes_five_models_without_placeholders(tmp_path):
    engine = make_engine_dir(tmp_path / "engines" / "t")
    repo = emit_repository(engine, tmp_path / "repo", RepositoryOptions(
        decoupled=False, max_queue_size=7, kv_cache_num_blocks=33, tensorrt_llm_instance_count=2))
    for model in MODELS:
        config = (repo / model / "config.pbtxt").read_text()
        assert "${" not in config
        assert f'name: "{model}"' in config
        assert (repo / model / "1").is_dir()
    for model in ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        assert "${" not in (repo / model / "1" / "model.py").read_text()
    trt = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "decoupled: false" in trt and "max_queue_size: 7" in trt
    assert "max_batch_size: 8" in trt  # from the engine's limits
    assert 'key: "kv_cache_num_blocks" value: { string_value: "33" }' in trt
    assert "count: 2" in trt
    assert 'string_value: "../engines/t"' in trt  # relative: movable together


def test_emit_replaces_stale_models_and_keeps_other_files(tmp_path):
    engine = make_engine_dir(tmp_path / "engines" / "t")
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm" / "1").mkdir(parents=True)
    (repo / "tensorrt_llm" / "1" / "stale.py").write_text("x")
    (repo / "notes.txt").write_text("mine")
    emit_repository(engine, repo)
    assert not (repo / "tensorrt_llm" / "1" / "stale.py").exists()
    assert (repo / "notes.txt").read_text() == "mine"


def test_portable_path_relative_when_sharing_a_parent(tmp_path):
    assert portable_path(tmp_path / "a" / "e", tmp_path / "b") == "../a/e"
    assert portable_path(Path("/"), tmp_path) == "/"


@pytest.mark.parametrize("kwargs, field", [
    ({"tensorrt_llm_instance_count": 0}, "tensorrt_llm_instance_count"),
    ({"max_queue_size": -1}, "max_queue_size"),
    ({"max_queue_delay_microseconds": 1.5}, "max_queue_delay_microseconds"),
    ({"decoupled": "yes"}, "decoupled"),
    ({"kv_cache_num_blocks": 4, "kv_cache_memory_bytes": 10}, "not both"),
    ({"default_top_p": 0.0}, "default_top_p"),
    ({"default_temperature": -1.0}, "default_temperature"),
])
def test_options_are_validated_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RepositoryOptions(**kwargs)


def test_options_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key.*max_queue_sise"):
        RepositoryOptions.from_dict({"max_queue_sise": 3})
    assert RepositoryOptions.from_dict({"decoupled": False}).decoupled is False
    assert json.dumps(RepositoryOptions().to_dict())


def test_off_switches_follow_the_engine_and_the_options(tmp_path):
    engine = make_engine_dir(tmp_path / "engines" / "t")
    config = EngineConfig.load(engine)
    values = template_values(config, engine, tmp_path / "repo", RepositoryOptions())
    assert values["enable_kv_cache_reuse"] is True        # the engine caches by default
    assert values["enable_speculative_decoding"] is False  # and does not speculate
    config.speculative.mode = "ngram"
    off = RepositoryOptions(enable_kv_cache_reuse=False, enable_speculative_decoding=False)
    values = template_values(config, engine, tmp_path / "repo", off)
    assert values["enable_kv_cache_reuse"] is False and values["enable_speculative_decoding"] is False
    values = template_values(config, engine, tmp_path / "repo", RepositoryOptions())
    assert values["enable_speculative_decoding"] is True
    repo = emit_repository(engine, tmp_path / "repo", off)
    trt = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "enable_kv_cache_reuse" value: { string_value: "false" }' in trt
    assert 'key: "cuda_graph_mode" value: { string_value: "true" }' in trt
    eager = emit_repository(engine, tmp_path / "eager", RepositoryOptions(cuda_graph_mode=False))
    assert ('key: "cuda_graph_mode" value: { string_value: "false" }'
            in (eager / "tensorrt_llm" / "config.pbtxt").read_text())


def test_the_serving_section_becomes_tensorrt_llm_parameters(tmp_path):
    from builder.spec.build_spec import ServingSpec

    engine = make_engine_dir(tmp_path / "engines" / "t")
    repo = emit_repository(engine, tmp_path / "repo", RepositoryOptions(),
                           ServingSpec(max_waiting_requests=5, priority_aging_rate=2.5))
    trt = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "max_waiting_requests" value: { string_value: "5" }' in trt
    # default: 8 x max_num_tokens (Limits' default 1024), at least max_input_len
    assert 'key: "max_waiting_prompt_tokens" value: { string_value: "8192" }' in trt
    assert 'key: "priority_aging_rate" value: { string_value: "2.5" }' in trt
    for model in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
        text = (repo / model / "config.pbtxt").read_text()
        assert '{ name: "timeout_ms" data_type: TYPE_UINT64' in text, model
        assert '{ name: "priority" data_type: TYPE_INT32' in text, model
    ensemble = (repo / "ensemble" / "config.pbtxt").read_text()
    assert 'input_map { key: "timeout_ms" value: "timeout_ms" }' in ensemble
    assert 'input_map { key: "priority" value: "priority" }' in ensemble

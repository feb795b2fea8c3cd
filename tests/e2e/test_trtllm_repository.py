"""The repository of a trtllm engine for NVIDIA's container: every name is NVIDIA's, every value
filled, and the CPU tritonserver parses it all, failing only on the missing tensorrtllm backend."""
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

import tiny
from builder.pipeline.engine_builder import build_engine
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.spec.load import spec_from_dict

NVIDIA = json.loads((Path(__file__).parents[1] / "data" / "nvidia_tensorrt_llm_config_names.json")
                    .read_text())


@pytest.fixture(scope="module")
def trt_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trtrepo")
    checkpoint = tiny.make_checkpoint(tmp / "hf", "llama_gqa")
    spec = spec_from_dict({
        "name": "tiny-trt", "checkpoint": str(checkpoint), "target": "trtllm", "hardware": "l4",
        "output": str(tmp / "engines" / "tiny-trt"),
        "limits": {"max_batch_size": 8, "max_num_tokens": 128, "max_input_len": 64,
                   "max_seq_len": 128}})
    return build_engine(spec, console=Console(quiet=True), emit_repository=False)


def tensors(config: str, section: str) -> dict[str, str]:
    block = re.search(section + r" \[(.*?)\n\]", config, re.S).group(1)
    return dict(re.findall(r'name: "(\w+)" data_type: (\w+)', block))


def test_cpp_backend_config_uses_only_nvidia_names(trt_engine, tmp_path):
    repo = emit_repository(trt_engine, tmp_path / "repo", RepositoryOptions(
        kv_cache_num_blocks=64, batch_scheduler_policy="max_utilization"))
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble", "postprocessing",
                                                      "preprocessing", "tensorrt_llm"]
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "${" not in config and f'backend: "{NVIDIA["backend"]}"' in config
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()  # the C++ backend has none
    for section in ("input", "output"):
        ours, theirs = tensors(config, section), NVIDIA[section + "s"]
        unknown = sorted(set(ours) - set(theirs))
        assert not unknown, f"{section}s NVIDIA's template does not have: {unknown}"
        assert {n: ours[n] for n in ours} == {n: theirs[n] for n in ours}  # same data types
    for name in NVIDIA["required_inputs"]:
        assert name in tensors(config, "input")
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config))
    assert set(params) <= set(NVIDIA["parameters"]), set(params) - set(NVIDIA["parameters"])
    for key, allowed in NVIDIA["parameter_values"].items():
        assert params[key] in allowed
    assert all(value != "" for value in params.values())  # unset ones are absent, not empty
    assert params["gpt_model_path"] == str((trt_engine / "trtllm_engine").resolve())
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"  # the l4 profile's
    assert params["max_tokens_in_paged_kv_cache"] == str(64 * 16)
    assert params["enable_kv_cache_reuse"] == "true" == params["enable_chunked_context"]
    assert params["batch_scheduler_policy"] == "max_utilization"


def test_ensemble_reads_only_outputs_the_cpp_backend_has(trt_engine, tmp_path):
    repo = emit_repository(trt_engine, tmp_path / "repo")
    ensemble = (repo / "ensemble" / "config.pbtxt").read_text()
    step = ensemble.split('model_name: "tensorrt_llm"')[1].split("model_name:")[0]
    used = set(re.findall(r'output_map \{ key: "(\w+)"', step))
    declared = set(tensors((repo / "tensorrt_llm" / "config.pbtxt").read_text(), "output"))
    assert used <= declared, used - declared
    assert 'input_map { key: "end_id" value: "_END_ID" }' in step


def test_python_backend_over_tensorrt_llm_is_refused_not_emitted_broken(trt_engine, tmp_path):
    with pytest.raises(ValueError, match="repository.tensorrt_llm_backend: 'python' over "
                                         "TensorRT-LLM's executor is not built yet"):
        emit_repository(trt_engine, tmp_path / "repo",
                        RepositoryOptions(tensorrt_llm_backend="python"))
    assert not (tmp_path / "repo" / "tensorrt_llm").exists()


def test_preprocessing_supplies_an_end_id_and_stops_on_every_eos():
    import numpy as np

    from triton_backend.models.end_ids import add_end_ids
    from triton_backend.models.word_list import from_word_list, to_word_list

    outputs = {"STOP_WORDS_IDS": to_word_list([[7, 8]])[None]}
    got = add_end_ids(outputs, {}, [2, 9], pad_id=0)
    assert got["OUT_END_ID"].tolist() == [[2]] and got["OUT_PAD_ID"].tolist() == [[0]]
    assert from_word_list(got["STOP_WORDS_IDS"], "stop_words") == [[7, 8], [9]]
    own = add_end_ids(outputs, {"END_ID": np.array([[5]], np.int32)}, [2, 9], pad_id=0)
    assert own["OUT_END_ID"].tolist() == [[5]]
    assert from_word_list(own["STOP_WORDS_IDS"], "stop_words") == [[7, 8]]


@pytest.mark.slow
def test_cpu_tritonserver_parses_everything_and_misses_only_the_tensorrtllm_backend(trt_engine,
                                                                                  tmp_path):
    from builder.serving.serve import start_tritonserver

    repo = emit_repository(trt_engine, tmp_path / "repo")
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError):
        start_tritonserver(repo, ready_timeout=120, log_path=log)
    text = log.read_text()
    failures = re.findall(r"failed to load '(\w+)'.*", text)
    assert set(failures) <= {"tensorrt_llm", "ensemble"}, text[-3000:]
    assert re.search(r"failed to load 'tensorrt_llm' version 1: Invalid argument: unable to find "
                     r"backend library for backend 'tensorrtllm'", text), text[-3000:]
    for model in ("preprocessing", "postprocessing"):
        assert re.search(rf"successfully loaded '{model}'", text), text[-3000:]
    assert "failed to parse" not in text.lower() and "unexpected" not in text.lower()

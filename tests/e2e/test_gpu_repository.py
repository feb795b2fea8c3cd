"""A GPU engine's repository in the real tritonserver (the nvidia-pytriton wheel's, 2.51) on this
machine without a GPU: every model parses; the tensorrt_llm model's instance is where the
repository put it, and only that instance fails, for want of a GPU.

The KIND_GPU refusal's wording is the GPU-enabled build's (a server built without GPU support
says it "does not support GPUs"), and the KIND_MODEL instance reaches the engine, which names
the device gpu_device_ids gave it."""
import re

import pytest
from rich.console import Console

import tiny
from builder.pipeline.engine_builder import build_engine
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.serve import start_tritonserver
from builder.spec.load import spec_from_dict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpurepo")
    checkpoint = tiny.make_checkpoint(tmp / "hf", "llama_gqa")
    spec = spec_from_dict({
        "name": "tiny-gpu", "checkpoint": str(checkpoint), "hardware": "h100-80gb",
        "output": str(tmp / "engines" / "tiny-gpu"), "kv_cache": {"tokens_per_block": 8},
        "limits": {"max_batch_size": 8, "max_num_tokens": 128, "max_input_len": 64,
                   "max_seq_len": 128}})
    return build_engine(spec, console=Console(quiet=True), emit_repository=False)


def _server_log(repo, tmp_path) -> str:
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError):  # tensorrt_llm (and the ensemble over it) cannot load
        start_tritonserver(repo, ready_timeout=180, log_path=log)
    text = log.read_text()
    failed = set(re.findall(r"failed to load '(\w+)'", text))
    assert "tensorrt_llm" in failed and failed <= {"tensorrt_llm", "ensemble"}, text[-3000:]
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert re.search(rf"successfully loaded '{model}'", text), text[-3000:]
    assert "failed to parse" not in text.lower()
    return text


def test_kind_gpu_is_refused_by_a_gpu_enabled_server_without_a_gpu(gpu_engine, tmp_path):
    repo = emit_repository(gpu_engine, tmp_path / "repo")
    text = _server_log(repo, tmp_path)
    assert re.search(r"failed to load 'tensorrt_llm' version 1: Invalid argument: instance group "
                     r"tensorrt_llm_0 of model tensorrt_llm has kind KIND_GPU but no GPUs are "
                     r"available", text), text[-3000:]
    assert "does not support GPUs" not in text


def test_kind_model_runs_the_engine_on_its_gpu_device_ids(gpu_engine, tmp_path):
    repo = emit_repository(gpu_engine, tmp_path / "repo", RepositoryOptions(
        tensorrt_llm_instance_kind="model", gpu_device_ids="0", engine_isolation="thread"))
    text = _server_log(repo, tmp_path)
    assert "TRITONBACKEND_ModelInstanceInitialize: tensorrt_llm_0_0 (MODEL device 0)" in text
    assert re.search(r"device cuda:0: the engine \(hardware h100-80gb\) runs on a CUDA GPU and "
                     r"none is visible", text), text[-3000:]

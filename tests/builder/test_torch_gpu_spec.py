"""`target: torch` on a GPU, in the spec: which hardware, dtypes and quantizations it accepts,
the KV fraction its engine records, the limits sized from the profile's memory, and its
Kubernetes manifests (GPU limit, node selector, toleration)."""
from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from builder.cli import main
from builder.spec.hardware import PROFILES
from builder.spec.build_spec import SpecError
from builder.spec.load import spec_from_dict
from builder.spec.torch_gpu import gpu_limits, kv_free_fraction
from deploy_helpers import KUBERNETES_VERSION, REPO, all_objects
from triton_backend.engine.config import Limits, ModelShape

BASE = {"name": "m", "checkpoint": "some/dir"}
LLAMA_8B = ModelShape(architecture="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)


@pytest.mark.parametrize("hardware", ["l4", "a100-40gb", "a100-80gb", "h100-80gb", "cuda"])
def test_every_gpu_profile_builds_a_torch_engine_in_bf16_by_default(hardware):
    spec = spec_from_dict({**BASE, "hardware": hardware})
    assert spec.target == "torch" and spec.dtype == "bfloat16"
    for dtype in ("float16", "float32"):
        assert spec_from_dict({**BASE, "hardware": hardware, "dtype": dtype}).dtype == dtype


@pytest.mark.parametrize("hardware", ["l4", "h100-80gb", "cuda"])
def test_fp8_weights_on_fp8_gpus_and_where_the_gpu_decides(hardware):
    spec = spec_from_dict({**BASE, "hardware": hardware, "quantization": {"weights": "fp8"}})
    assert spec.quantization.weights == "fp8"
    int4 = spec_from_dict({**BASE, "hardware": hardware, "quantization": {"weights": "int4_rtn"}})
    assert int4.quantization.weights == "int4_rtn"


@pytest.mark.parametrize("patch, message", [
    ({"hardware": "a100-80gb", "quantization": {"weights": "fp8"}},
     "quantization.weights: fp8 needs FP8 tensor cores (SM >= 89: l4, h100-80gb, or cuda where "
     "the GPU decides); a100-80gb is SM 80"),
    ({"dtype": "float16"}, "dtype: float16 is for GPU engines (hardware l4, a100-40gb, a100-80gb, "
                           "h100-80gb, cuda); a CPU engine computes in bfloat16 or float32"),
    ({"hardware": "h100-80gb", "parallelism": {"tp": 2}},
     "parallelism: tp/pp are TensorRT-LLM's (target trtllm); target torch runs on one GPU"),
    ({"hardware": "h100-80gb", "quantization": {"lm_head": "int8"}},
     "quantization.lm_head: 'int8' runs on the CPU kernels; a GPU engine (hardware h100-80gb) "
     "uses none"),
    ({"hardware": "l4", "target": "naive"}, "hardware: target naive runs on the CPU (hardware: cpu)"),
    ({"hardware": "cuda", "target": "trtllm"},
     "got 'cuda' (cuda, any CUDA GPU, is for target torch: trtllm-build needs the GPU's SM"),
    ({"repository": {"kv_cache_free_gpu_mem_fraction": 0.5}},
     "repository.kv_cache_free_gpu_mem_fraction: 0.5 sizes the KV cache from a GPU's free "
     "memory; hardware cpu sizes it by kv_cache.num_blocks or kv_cache.memory_bytes"),
    ({"hardware": "l4", "repository": {"kv_cache_free_gpu_mem_fraction": 1.0}},
     "repository.kv_cache_free_gpu_mem_fraction must be in (0, 1), got 1.0"),
    ({"hardware": "l4", "kv_cache": {"free_gpu_mem_fraction": 0.6},
      "repository": {"kv_cache_free_gpu_mem_fraction": 0.5}},
     "kv_cache.free_gpu_mem_fraction (0.6) and repository.kv_cache_free_gpu_mem_fraction (0.5) "
     "differ; give one"),
    ({"hardware": "l4", "kv_cache": {"num_blocks": 64},
      "repository": {"kv_cache_free_gpu_mem_fraction": 0.5}},
     "repository.kv_cache_free_gpu_mem_fraction: the KV pool is sized by kv_cache.num_blocks / "
     "kv_cache.memory_bytes in this spec"),
    ({"repository": {"tensorrt_llm_instance_kind": "gpu"}},
     "repository.tensorrt_llm_instance_kind: 'gpu' places a GPU engine; this engine's hardware "
     "is cpu (use auto)"),
    ({"hardware": "l4", "repository": {"tensorrt_llm_instance_kind": "tpu"}},
     "repository.tensorrt_llm_instance_kind must be one of ['auto', 'gpu', 'model'], got 'tpu'"),
    ({"hardware": "l4", "repository": {"gpu_device_ids": "1"}},
     "repository.gpu_device_ids: only with tensorrt_llm_instance_kind model"),
    ({"hardware": "l4", "repository": {"tensorrt_llm_instance_kind": "model",
                                       "gpu_device_ids": "0,1"}},
     "repository.gpu_device_ids '0,1': the torch engine runs on one GPU per instance"),
    ({"hardware": "l4", "repository": {"tensorrt_llm_instance_kind": "model",
                                       "gpu_device_ids": "0;1;2"}},
     "repository.gpu_device_ids: 3 device ids for 1 instance(s)"),
])
def test_bad_gpu_specs_name_the_field(patch, message):
    with pytest.raises(SpecError) as err:
        spec_from_dict({**BASE, **patch})
    assert message in str(err.value)


def test_the_kv_fraction_is_the_specs_else_the_profiles_and_none_where_blocks_size_the_pool():
    assert kv_free_fraction(spec_from_dict({**BASE, "hardware": "h100-80gb"})) == 0.9
    for key, section in (("kv_cache_free_gpu_mem_fraction", "repository"),
                         ("free_gpu_mem_fraction", "kv_cache")):
        spec = spec_from_dict({**BASE, "hardware": "cuda", section: {key: 0.7}})
        assert kv_free_fraction(spec) == 0.7
    both = spec_from_dict({**BASE, "hardware": "l4", "kv_cache": {"free_gpu_mem_fraction": 0.7},
                           "repository": {"kv_cache_free_gpu_mem_fraction": 0.7}})
    assert kv_free_fraction(both) == 0.7
    sized = spec_from_dict({**BASE, "hardware": "l4", "kv_cache": {"memory_bytes": "1GiB"}})
    assert kv_free_fraction(sized) is None


def test_limits_are_sized_from_the_profile_for_the_torch_kv_layout():
    fallback = Limits()
    bf16 = spec_from_dict({**BASE, "hardware": "h100-80gb"})
    limits, record = gpu_limits(bf16, LLAMA_8B, fallback)
    assert limits.max_seq_len == 8192 and limits.max_input_len == 4096
    assert limits.max_batch_size & (limits.max_batch_size - 1) == 0 and limits.max_num_tokens == 8192
    assert record["hardware"] == "h100-80gb" and record["sm"] == 90
    # float32 keys and values take twice the bytes of bf16 ones: half the tokens fit.
    fp32, fp32_record = gpu_limits(spec_from_dict({**BASE, "hardware": "h100-80gb",
                                                   "dtype": "float32"}), LLAMA_8B, fallback)
    assert fp32_record["memory"]["kv_tokens"] < record["memory"]["kv_tokens"] / 2
    assert fp32.max_batch_size < limits.max_batch_size
    # An L4 holds the 8B weights in bf16 but not 131072 tokens of context; the error says what to do.
    long = spec_from_dict({**BASE, "hardware": "l4",
                           "limits": {"max_input_len": 4096, "max_seq_len": 131072}})
    with pytest.raises(ValueError, match=r"limits.max_seq_len \(131072\) does not fit the KV cache "
                                         r"on l4: .* lower limits.max_seq_len or quantize the KV "
                                         r"cache$"):
        gpu_limits(long, LLAMA_8B, fallback)


def test_any_cuda_gpu_sizes_nothing_before_the_engine_runs():
    fallback = Limits(max_batch_size=4)
    limits, record = gpu_limits(spec_from_dict({**BASE, "hardware": "cuda"}), LLAMA_8B, fallback)
    assert limits is fallback and record == {"hardware": "cuda", "sm": None}
    assert PROFILES["cuda"].is_gpu and not PROFILES["cuda"].sized and PROFILES["cuda"].may_run_fp8
    assert not PROFILES["a100-40gb"].may_run_fp8 and not PROFILES["cpu"].may_run_fp8


@pytest.mark.parametrize("hardware, selector", [
    ("h100-80gb", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
    ("l4", {"nvidia.com/gpu.product": "NVIDIA-L4"}),
    ("cuda", {"nvidia.com/gpu.present": "true"}),
])
def test_deploy_gives_a_torch_gpu_engine_its_gpu(tmp_path, hardware, selector):
    data = yaml.safe_load((REPO / "examples" / "smollm2-135m.yaml").read_text())
    data["hardware"] = hardware
    data["deployment"]["image"] = "registry.example.com/llm-forge/smollm2-135m:0.1.0-gpu"
    spec = tmp_path / "gpu.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    objects = all_objects(tmp_path / "o")
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["metadata"]["name"] == "smollm2-135m")
    pod = deployment["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["command"] == ["forge"] and server["args"][:1] == ["serve"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == selector
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]
    for obj in objects:
        if obj["kind"] in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)

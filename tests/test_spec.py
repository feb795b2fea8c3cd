"""The build spec and the engine config reject bad input with messages naming the key."""
import json

import pytest

from builder.spec import SpecError, load_spec, parse_bytes, spec_from_dict
from triton_backend.engine.config import EngineConfig

BASE = {"name": "m", "checkpoint": "some/dir"}


@pytest.mark.parametrize("patch, message", [
    ({"bogus": 1}, "bogus: unknown key"),
    ({"limits": {"max_batch_sizes": 4}}, "limits.max_batch_sizes: unknown key"),
    ({"limits": {"max_batch_size": 0}}, "limits.max_batch_size must be an integer >= 1, got 0"),
    ({"limits": {"max_input_len": 512, "max_seq_len": 512}}, "limits.max_input_len (512) must be <"),
    ({"kv_cache": {"tokens_per_block": -1}}, "kv_cache.tokens_per_block must be an integer >= 1"),
    ({"kv_cache": {"num_blocks": 4, "memory_bytes": "1GiB"}}, "give num_blocks or memory_bytes"),
    ({"kv_cache": {"memory_bytes": "lots"}}, "kv_cache.memory_bytes: expected bytes"),
    ({"target": "trtllm"}, "hardware: target trtllm needs a GPU profile"),
    ({"target": "tpu"}, "target: must be one of"),
    ({"dtype": "int3"}, "dtype: must be one of"),
    ({"hardware": "h100"}, "hardware: must be one of"),
    ({"name": "bad name!"}, "name: letters, digits"),
    ({"checkpoint": None}, "checkpoint: required"),
    ({"quantization": {"weights": "int2"}}, "quantization.weights: must be one of"),
    ({"quantization": {"kv_cache": "fp4"}}, "quantization.kv_cache: must be one of"),
    ({"quantization": {"mystery": 1}}, "quantization.mystery: unknown key"),
    ({"quantization": {"weights": "int4_awq", "group_size": 0}},
     "quantization.group_size: must be an integer >= 1, got 0"),
    ({"quantization": {"calibration": {"samples": -1}}},
     "quantization.calibration.samples: must be an integer >= 1"),
    ({"quantization": {"quality": {"bogus": 1}}}, "quantization.quality.bogus"),
    ({"repository": {"instances": 2}}, "repository: unknown key(s) instances"),
])
def test_bad_specs_name_the_key(patch, message):
    with pytest.raises(SpecError) as err:
        spec_from_dict({**BASE, **patch})
    assert message in str(err.value)


def test_yaml_spec_with_overrides(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("name: a\ncheckpoint: x\nkv_cache:\n  memory_bytes: 512MiB\n")
    spec = load_spec(path, {"dtype": "float32", "output": None})
    assert spec.dtype == "float32" and spec.kv_cache.memory_bytes == 512 * 2**20
    assert str(spec.output_dir) == "engines/a"
    assert parse_bytes("k", "1.5 GB") == 1_500_000_000


def test_engine_refuses_unknown_format_version(tiny_engines, tmp_path):
    config = json.loads((tiny_engines("llama_gqa") / "config.json").read_text())
    config["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99 is not supported"):
        EngineConfig.from_dict(config)

"""The spec's `quantization` section -> QuantizeOptions: defaults and errors naming the field."""
from __future__ import annotations

import pytest

from builder.quantize import QuantizeOptions


def test_defaults_from_an_empty_section():
    options = QuantizeOptions.from_spec({})
    assert (options.weights, options.kv_cache, options.group_size) == ("none", "none", 128)
    assert options.exclude_modules == ["lm_head"] and not options.enabled
    assert options.calibration.dataset == "builtin"


def test_from_a_spec_dataclass_like_section():
    class Section:  # what builder.spec.build_spec.QuantizationSpec carries
        weights, kv_cache, group_size = "int4_awq", "fp8", 64
        exclude_modules = ["lm_head"]
        calibration = {"dataset": "data.jsonl", "samples": 8}
        quality = {}

    options = QuantizeOptions.from_spec(Section())
    assert (options.weights, options.kv_cache, options.group_size) == ("int4_awq", "fp8", 64)
    assert (options.calibration.dataset, options.calibration.samples) == ("data.jsonl", 8)
    assert options.enabled


@pytest.mark.parametrize("section,message", [
    ({"weights": "int3"}, r"quantization\.weights: must be one of"),
    ({"kv_cache": "fp16"}, r"quantization\.kv_cache: must be one of"),
    ({"group_size": 0}, r"quantization\.group_size: must be an integer >= 1"),
    ({"calibration": {"samples": 0}}, r"quantization\.calibration\.samples: must be an integer"),
    ({"calibration": {"size": 3}}, r"quantization\.calibration\.size: unknown key"),
    ({"weights": "int4_rtn", "zero_point": "yes"},
     r"quantization\.zero_point: must be true or false, got 'yes'"),
    ({"weights": "int4_awq", "zero_point": True},
     r"quantization\.zero_point: needs weights int4_rtn \(int4_awq and fp8 are symmetric"),
    ({"weights": "int4_rtn", "zero_point": True, "rounding": "gptq"},
     r"quantization\.rounding: must be one of \['minmax', 'search', 'activation'\], got 'gptq'"),
    ({"weights": "int4_rtn", "rounding": "activation"},
     r"quantization\.rounding: 'activation' searches a zero-point grid; it needs zero_point: true"),
    ({"lm_head": "int4"}, r"quantization\.lm_head: must be one of \['none', 'int8'\], got 'int4'"),
])
def test_errors_name_the_field(section, message):
    with pytest.raises(ValueError, match=message):
        QuantizeOptions.from_spec(section)


def test_modelopt_advice_to_reinstall_it_is_not_shown():
    """ModelOpt's import warns about the pinned transformers and advises `pip install -U
    nvidia-modelopt[hf]`, which would replace the pinned packages: the builder does not show it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import builder.quantize\n"
                           "import modelopt.torch.quantization"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "pip install -U nvidia-modelopt" not in done.stderr + done.stdout

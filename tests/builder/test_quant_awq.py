"""AWQ earns its place: on a layer whose input has a few large-magnitude channels, ModelOpt's AWQ
(what `int4_awq` runs) leaves much less output error than round-to-nearest at the same group size."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is the `quant` extra")

from builder.quantize.modelopt_run import calibrate, modelopt_config  # noqa: E402
from builder.quantize.options import CalibrationOptions, QuantizeOptions  # noqa: E402


class OneLayer(nn.Module):
    """A stand-in for a decoder projection, fed by an embedding so calibration passes token ids."""

    def __init__(self, activations: torch.Tensor) -> None:
        super().__init__()
        self.inputs = nn.Embedding.from_pretrained(activations)
        self.proj = nn.Linear(activations.shape[1], 128, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inputs(ids))


def _layer_and_data(seed: int = 0):
    torch.manual_seed(seed)
    activations = torch.randn(512, 256)
    # A few salient channels, as LLM activations have, one per quantization group: RTN's error
    # on their weights is amplified 50x; AWQ scales those weights up before rounding.
    activations[:, [3, 70, 141, 200]] *= 50.0
    layer = OneLayer(activations)
    ids = torch.arange(512).reshape(8, 64)
    return layer, ids


def _output_error(weights: str) -> float:
    layer, ids = _layer_and_data()
    with torch.no_grad():
        reference = layer(ids)
    options = QuantizeOptions(weights=weights, group_size=64,
                              calibration=CalibrationOptions(samples=8, seq_len=64, batch_size=4))
    calibrate(layer, options, ids, progress=lambda message: None)
    with torch.no_grad():
        return ((layer(ids) - reference).pow(2).mean() / reference.pow(2).mean()).item()


def test_awq_output_error_is_well_below_rtn():
    awq, rtn = _output_error("int4_awq"), _output_error("int4_rtn")
    assert awq < 0.3 * rtn, f"AWQ relative MSE {awq:.3g} vs RTN {rtn:.3g}"


def test_modelopt_config_applies_group_size_exclusions_and_kv_cache():
    layer, _ = _layer_and_data()
    options = QuantizeOptions(weights="int4_awq", kv_cache="int8", group_size=64)
    config = modelopt_config(layer, options)
    weight_entries = [e for e in config["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer"]
    assert weight_entries[0]["cfg"]["block_sizes"][-1] == 64
    assert config["algorithm"]["method"] == "awq_lite"
    kv = [e for e in config["quant_cfg"] if e.get("quantizer_name") == "*[kv]_bmm_quantizer"]
    assert kv[0]["cfg"] == {"num_bits": 8, "axis": None}
    assert modelopt_config(layer, QuantizeOptions(weights="int4_rtn"))["algorithm"] == "max"

"""The offline half of quantization: calibrate with ModelOpt, write a TensorRT-LLM checkpoint, and
repack it into the torch runtime's weights (`triton_backend.engine.quant` is the runtime half).

The builder calls `quantize_checkpoint(hf_dir, engine_dir, QuantizeOptions.from_spec(section),
dtype, progress)` and records the returned `QuantizationResult` in the engine config.
"""
from builder.quantize.options import CalibrationOptions, QuantizeOptions
from builder.quantize.quantizer import quantize_checkpoint, quantize_engine
from builder.quantize.result import QuantizationResult

__all__ = ["CalibrationOptions", "QuantizeOptions", "QuantizationResult", "quantize_checkpoint",
           "quantize_engine"]

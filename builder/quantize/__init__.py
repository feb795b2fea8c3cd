"""The offline half of quantization: calibrate with ModelOpt, write a TensorRT-LLM checkpoint, and
repack it into the torch runtime's weights (`triton_backend.engine.quant` is the runtime half).

The builder calls `quantize_checkpoint(hf_dir, engine_dir, QuantizeOptions.from_spec(section),
dtype, progress)` and records the returned `QuantizationResult` in the engine config.
"""
import warnings

from builder.quantize.options import CalibrationOptions, QuantizeOptions
from builder.quantize.quantizer import quantize_checkpoint, quantize_engine
from builder.quantize.result import QuantizationResult

# ModelOpt warns, when first imported, that the transformers it finds is newer than those it was
# tested with, and advises `pip install -U nvidia-modelopt[hf]`: that extra would downgrade
# transformers (< 5.15) and pull deepspeed, diffusers and a CUDA torch into the pinned setup. The
# quantization tests run ModelOpt with the transformers `make setup` installs, so the advice is
# not shown (docs/quantization.md).
MODELOPT_VERSION_ADVICE = r"transformers \S+ is not tested with current version of modelopt"
warnings.filterwarnings("ignore", message=MODELOPT_VERSION_ADVICE, category=UserWarning)

__all__ = ["CalibrationOptions", "QuantizeOptions", "QuantizationResult", "quantize_checkpoint",
           "quantize_engine"]

"""EXL3: the trellis-quantized weight format (ExLlamaV3-compatible), its loader and its quantizer."""
from .format import MARKER_VALUES, EXL3Format, EXL3Linear, quantize_linear, unpack_signs
from .quantize import QuantizedTensors, QuantStats, dequantize, quantize_group

__all__ = [
    "EXL3Format",
    "EXL3Linear",
    "MARKER_VALUES",
    "QuantStats",
    "QuantizedTensors",
    "dequantize",
    "quantize_group",
    "quantize_linear",
    "unpack_signs",
]

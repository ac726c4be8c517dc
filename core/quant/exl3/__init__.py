"""EXL3: the trellis-quantized weight format, its quantizer and loader."""

"""Quantized checkpoints: what a checkpoint's quantization is, and dequantizing while streaming."""

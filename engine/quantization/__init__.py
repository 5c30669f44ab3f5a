"""Quantized linear layers (``linear_methods.py``): how a weight is stored, loaded and
multiplied, in the model's dtype, FP8 (W8A8 and weight-only) or int8 (W8A16)."""

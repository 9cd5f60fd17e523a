"""Quantized weights matched bit for bit to their reference implementations (Q4_0, W4A16, GGUF
and compressed-tensors import), host tables, and opening any checkpoint (`load.py`)."""

"""Weight quantization formats, matched bit for bit to their reference implementations."""

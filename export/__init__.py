"""From checkpoint to bundle: the static methods lowered to ExecuTorch, ONNX or Core ML in each
backend's form, and the bundle written around them."""

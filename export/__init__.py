"""From checkpoint to bundle: static-shape graphs, lowering to ExecuTorch (Core ML and ONNX to come)."""

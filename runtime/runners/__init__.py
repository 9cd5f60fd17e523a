"""What executes a bundle's static methods, for `runtime.backends.StaticBackend`: one runner per
program format (ExecuTorch, ONNX Runtime, Core ML) and the eager methods themselves."""

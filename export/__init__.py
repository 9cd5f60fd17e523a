"""From checkpoint to bundle: static-shape graphs and their lowering to ExecuTorch."""

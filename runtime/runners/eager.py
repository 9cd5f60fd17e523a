"""Runs a `StaticBundle`'s methods in eager PyTorch: the numerical reference of every lowered
form (the bundle computes in the form it was put in)."""

from __future__ import annotations

import torch
from torch import Tensor

from edgemtp.model.static import StaticBundle


class EagerRunner:
    """Runs the static wrappers in eager PyTorch."""

    def __init__(self, bundle: StaticBundle):
        self.shapes = bundle.shapes
        self.methods = {name: m for name, (m, _) in bundle.methods(debug=True).items()}

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        with torch.no_grad():
            out = self.methods[method](*inputs)
        return out if isinstance(out, tuple) else (out,)

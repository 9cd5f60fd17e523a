"""The files of an ONNX bundle's folder: one `.onnx` per method, the `weights.bin` they share,
and `methods.json`, the index `OnnxRunner` reads (each method's I/O and the cache writes it
returns, the cache arrays to allocate, the session options).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgemtp.export.onnx.graph import WEIGHTS, WeightFile, dtype_name
from edgemtp.export.onnx.method import MethodGraph
from edgemtp.runtime.runners.onnx import INDEX

# A DQ(int4) -> MatMul pair (the htp bundle on the CPU EP) fuses to MatMulNBits with
# accuracy_level 4 (int8 activations) unless this says 0 (fp32, exact weights).
SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}


def write_methods(
    methods: list[MethodGraph], folder: Path, delegate: str, shapes: dict[str, int]
) -> tuple[list[str], WeightFile, dict[str, Any]]:
    """Write `methods` into `folder`; returns the files written, the weight file and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = WeightFile(folder / WEIGHTS)
    files = []
    index_methods: dict[str, Any] = {}
    try:
        for m in methods:
            model = m.graph.model(weights)
            (folder / f"{m.name}.onnx").write_bytes(model.SerializeToString())
            files.append(f"{m.name}.onnx")
            index_methods[m.name] = _method_spec(m)
    finally:
        weights.close()
    files.append(WEIGHTS)
    cache: dict[str, Any] = {}
    for m in methods:
        for name in m.cache_inputs:
            elem, shape = m.graph.types[name]
            fill = -1 if name.startswith("cache.pos_") else 0
            cache[name] = {"shape": list(shape), "dtype": dtype_name(elem), "fill": fill}
    index = {
        "format": "edgemtp-onnx/1",
        "delegate": delegate,
        "shapes": shapes,
        "session_config": SESSION_CONFIG,
        "cache": dict(sorted(cache.items())),
        "methods": index_methods,
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    files.append(INDEX)
    return files, weights, index


def _method_spec(m: MethodGraph) -> dict[str, Any]:
    def io(names: list[str]) -> list[dict[str, Any]]:
        out = []
        for n in names:
            elem, shape = m.graph.types[n]
            out.append({"name": n, "shape": list(shape), "dtype": dtype_name(elem)})
        return out

    cache_outputs = [u["output"] for u in m.updates] + sorted(
        {u["slots"] for u in m.updates if "slots" in u}
    )
    return {
        "file": f"{m.name}.onnx",
        "inputs": io(m.inputs),
        "outputs": io(m.outputs),
        "cache_inputs": m.cache_inputs,
        "cache_outputs": io(cache_outputs),
        "updates": m.updates,
    }

"""Runs an ONNX bundle's methods with ONNX Runtime, the cache on the host (`export/onnx/method.py`
describes the graphs and their cache outputs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes

INDEX = "methods.json"  # the bundle's methods, their files, I/O and cache updates


# --- running --------------------------------------------------------------------------------------


@dataclass
class _Method:
    session: Any
    binding: Any
    spec: dict[str, Any]
    scratch: dict[str, np.ndarray]  # the cache-update outputs of the last call
    inputs: dict[str, np.ndarray]  # bound once; each call copies its inputs in
    outputs: dict[str, np.ndarray]  # bound once; each call returns copies
    observe: dict[str, list[int]] = field(default_factory=dict)  # calibration: name -> shape


@contextmanager
def flush_denormals() -> Iterator[None]:
    """Denormal floats read and written as zero on this thread for the duration (x86 FTZ/DAZ,
    which ONNX Runtime's kernels then run under). A softmax over peaked scores (Gemma 4's
    attention at head dim 256-512) leaves probabilities below 1e-38, and the matmul after it
    runs them at a small fraction of its speed. Their contribution (< 1e-38 each) is lost
    either way."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class OnnxRunner:
    """Runs the methods of an ONNX bundle folder (out_dir/onnx) with ONNX Runtime.

    The cache is one numpy array per cache buffer, wrapped once in an `OrtValue` and bound to
    every method reading it (target and drafter bind the same objects: no copies); after each
    call the runner writes the call's new rows into those arrays. `threads`: ORT intra-op
    threads per session (1 suits a shared 2-core host). `provider` overrides the bundle's
    delegate, e.g. "cpu" to check an htp (QDQ) bundle on the CPU EP. `observe` (calibration)
    also fetches the named values and keeps their min/max in `ranges`.
    """

    def __init__(
        self,
        folder: Path,
        shapes: StaticShapes,
        *,
        provider: str | None = None,
        threads: int = 1,
        observe: dict[str, list[str]] | None = None,
    ):
        import onnxruntime as ort

        self.folder = Path(folder)
        self.shapes = shapes
        self.index = json.loads((self.folder / INDEX).read_text())
        delegate = self.index["delegate"]
        provider = provider or delegate
        providers: list[Any]
        if provider == "htp":
            if "QNNExecutionProvider" not in ort.get_available_providers():
                raise EdgeMTPError(
                    "this ONNX bundle targets the Qualcomm HTP: it runs with ONNX Runtime's QNN "
                    "EP (pip install onnxruntime-qnn) on a Snapdragon device or Windows-on-Arm "
                    "host; the installed onnxruntime has no QNNExecutionProvider"
                )
            qnn = ("QNNExecutionProvider", {"backend_path": _qnn_backend()})
            providers = [qnn, "CPUExecutionProvider"]
        elif provider == "cpu":
            providers = ["CPUExecutionProvider"]
        else:
            raise EdgeMTPError(f"unknown provider '{provider}' (choose cpu or htp)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.set_denormal_as_zero", "1")  # worker threads
        for key, value in self.index["session_config"].items():
            options.add_session_config_entry(key, value)
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, Any] = {}
        for name, spec in self.index["cache"].items():
            arr = np.full(spec["shape"], spec["fill"], dtype=spec["dtype"])
            self.arrays[name] = arr
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
        self.methods: dict[str, _Method] = {}
        self._keep: list[Any] = []
        observe = observe or {}
        for name, spec in sorted(self.index["methods"].items()):
            session = ort.InferenceSession(
                str(self.folder / spec["file"]), options, providers=providers
            )
            binding = session.io_binding()
            for cache_name in spec["cache_inputs"]:
                binding.bind_ortvalue_input(cache_name, self.values[cache_name])
            # Every buffer is bound once: ONNX Runtime takes longer per call over arrays bound
            # afresh, a cost a small model's decode step notices.
            bound: dict[str, dict[str, np.ndarray]] = {}
            for kind in ("inputs", "outputs", "cache_outputs"):
                bound[kind] = {io["name"]: np.empty(io["shape"], io["dtype"]) for io in spec[kind]}
                for io_name, arr in bound[kind].items():
                    value = ort.OrtValue.ortvalue_from_numpy(arr)
                    if kind == "inputs":
                        binding.bind_ortvalue_input(io_name, value)
                    else:
                        binding.bind_ortvalue_output(io_name, value)
                    self._keep.append(value)
            shapes_of = {o.name: o.shape for o in session.get_outputs()}
            watched = {v: shapes_of[v] for v in observe.get(name, [])}
            self.methods[name] = _Method(
                session, binding, spec, bound["cache_outputs"], bound["inputs"],
                bound["outputs"], watched,
            )  # fmt: skip
        self.ranges: dict[str, dict[str, tuple[float, float]]] = {}
        self.bytes_copied = 0  # cache rows (and slot positions) written back on the host
        self._ort = ort

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        ort = self._ort
        m = self.methods[method]
        spec = m.spec
        for io, x in zip(spec["inputs"], inputs, strict=True):
            into = m.inputs[io["name"]]
            if tuple(x.shape) != into.shape:
                raise ValueError(f"{method}: input {io['name']} has shape {tuple(x.shape)}, "
                                 f"the bundle's is {into.shape}")  # fmt: skip
            np.copyto(into, x.detach().numpy(), casting="unsafe")
        watched = {name: np.empty(shape, np.float32) for name, shape in m.observe.items()}
        for name, arr in watched.items():
            m.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(arr))
        with flush_denormals():
            m.session.run_with_iobinding(m.binding)
        if m.observe:  # before the cache update: the cache as this call read it
            self._record(method, m, list(m.inputs.values()), watched)
        done = m.scratch
        for u in spec["updates"]:
            self.bytes_copied += done[u["output"]].nbytes
            if u["kind"] == "copy":
                self.arrays[u["cache"]][...] = done[u["output"]]
            elif u["kind"] == "rows":
                self.arrays[u["cache"]][:, done[u["slots"]]] = done[u["output"]]
        return tuple(torch.from_numpy(m.outputs[io["name"]].copy()) for io in spec["outputs"])

    def _record(
        self, method: str, m: _Method, inputs: list[np.ndarray], watched: dict[str, np.ndarray]
    ) -> None:
        """Calibration: widen the min/max of the observed values, float inputs and cache."""
        seen = self.ranges.setdefault(method, {})
        arrays = dict(watched)
        for io, arr in zip(m.spec["inputs"], inputs, strict=True):
            if arr.dtype == np.float32:
                arrays[io["name"]] = arr
        for name in m.spec["cache_inputs"]:
            if self.arrays[name].dtype == np.float32:
                arrays[name] = self.arrays[name]
        for name, arr in arrays.items():
            seen[name] = range_union(seen.get(name), (float(arr.min()), float(arr.max())))


def _qnn_backend() -> str:
    import sys

    return "QnnHtp.dll" if sys.platform == "win32" else "libQnnHtp.so"


def range_union(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))

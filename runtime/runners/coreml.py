"""Core ML packages: running their functions (macOS 15+) and reading them back (anywhere).

The package's calling protocol (`export/coreml.py` writes it): the logical inputs first, then
the slot positions, which the runner owns (int32, -1 = empty) and replaces with each function's
`new_pos_*`; one `MLState` holds the K/V for every function. Linux can read everything in a
package (functions, I/O, states, op types and dtypes, weight blobs); it cannot run it.
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes
from edgemtp.runtime.capabilities import macos_missing

SPEC_VERSION_IOS18 = 9
INT4_OP = "constexpr_blockwise_shift_scale"


class HostPositions:
    """The package's calling protocol: logical inputs first, then the slot positions, which
    the runner owns (int32, -1 = empty) and replaces with each function's `new_pos_*`."""

    shapes: StaticShapes
    io: dict[str, dict[str, list[str]]]
    slot_pos: dict[str, np.ndarray]

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        names = self.io[method]
        feeds = {n: x.numpy() for n, x in zip(names["inputs"], inputs, strict=False)}
        for n, x in feeds.items():
            feeds[n] = x.astype(np.float32 if x.dtype.kind == "f" else np.int32)
        feeds.update({f"pos_{k}": p for k, p in self.slot_pos.items()})
        out = self._run(method, feeds)
        for kind in self.slot_pos:
            if f"new_pos_{kind}" in out:
                self.slot_pos[kind] = np.asarray(out[f"new_pos_{kind}"], dtype=np.int32)
        logical = [n for n in names["outputs"] if not n.startswith("new_pos_")]
        return tuple(_torch(out[n]) for n in logical)


def _torch(x: np.ndarray) -> Tensor:
    x = np.asarray(x)
    return torch.from_numpy(x.astype(np.float32 if x.dtype.kind == "f" else np.int64))


def function_io(package: Path) -> dict[str, dict[str, list[str]]]:
    """Input and output names per function, in declaration order, from the package itself."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(package))
    return {
        f.name: {"inputs": [i.name for i in f.input], "outputs": [o.name for o in f.output]}
        for f in spec.description.functions
    }


class CoreMLRunner(HostPositions):
    """Runs a package's functions with Core ML (macOS 15+), all on one `MLState`."""

    def __init__(self, package: Path, shapes: StaticShapes, compute_units: str = "CPU_AND_GPU"):
        require_macos15()
        import coremltools as ct

        package = Path(package)
        self.shapes = shapes
        self.io = function_io(package)
        report = validate_mlpackage(package)["functions"]
        first = next(iter(self.io))
        inputs = report[first]["inputs"]
        self.slot_pos = {
            n.removeprefix("pos_"): np.full(inputs[n]["shape"], -1, np.int32)
            for n in inputs
            if n.startswith("pos_")
        }
        units = ct.ComputeUnit[compute_units]
        self.methods = {
            name: ct.models.MLModel(str(package), function_name=name, compute_units=units)
            for name in self.io
        }
        # One state for every function: the drafter reads the cache the target writes.
        self.state = self.methods[first].make_state()
        # Masked slots must hold finite values (0 * NaN would poison the attention sums).
        for name, state in report[first]["states"].items():
            self.state.write_state(name, np.zeros(state["shape"], np.float16))

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.methods[method].predict(feeds, state=self.state)


def require_macos15() -> None:
    """Core ML `predict` with states and multifunction packages needs macOS 15+."""
    missing = macos_missing(platform.system(), platform.mac_ver()[0])
    if missing:
        raise EdgeMTPError(f"{missing}: run it on a Mac, or export --backend executorch/onnx")


def weight_file(package: Path) -> Path:
    """A package's blob file: every weight its functions store."""
    return Path(package) / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"


def _name(op: Any) -> str:
    return op.outputs[0].name if op.outputs else ""


def _strip(name: str) -> str:
    """A weight's name without the suffixes coremltools' fp16 pass appends."""
    return name.removesuffix("_cast_fp16").removesuffix("_to_fp16")


def _functions(spec: Any) -> dict[str, Any]:
    """Function name -> its operations (proto), in declaration order."""
    out = {}
    for fd in spec.description.functions:
        fn = spec.mlProgram.functions[fd.name]
        out[fd.name] = fn.block_specializations[fn.opset].operations
    return out


# proto data type -> the blob file's read_/write_ method suffix
BLOB_KINDS = {10: "fp16", 11: "float", 21: "int8", 22: "int16", 23: "int32", 25: "int4"}
BLOB_KINDS |= {31: "uint8", 32: "uint16", 33: "uint32", 35: "uint4", 36: "uint2", 37: "uint1"}
BLOB_KINDS |= {38: "uint6", 39: "uint3"}


def blob_values(ops: Any) -> Iterator[Any]:
    """Every value of `ops` (and their nested blocks) stored in the blob file."""
    for op in ops:
        values = [*op.attributes.values()]
        values += [a.value for arg in op.inputs.values() for a in arg.arguments]
        yield from (v for v in values if v.HasField("blobFileValue"))
        for block in op.blocks:
            yield from blob_values(block.operations)


def read_blob(reader: Any, value: Any) -> np.ndarray:
    """One tensor stored in weight.bin, in its stored dtype (sub-byte integers one a byte)."""
    t = value.type.tensorType
    shape = [d.constant.size for d in t.dimensions]
    kind = BLOB_KINDS[t.dataType]
    data = getattr(reader, f"read_{kind}_data")(value.blobFileValue.offset)
    return np.asarray(data.view(np.float16) if kind == "fp16" else data).reshape(shape)


def package_weights(package: Path) -> dict[str, dict[str, np.ndarray | None]]:
    """The linear weights stored in the package's weight.bin, by module path with underscores
    (`target_layers_0_self_attn_q_proj`): int4 ones as {"data": codes (int8 for int4, uint8 for
    uint4), "scale": fp16, "offset": uint8 or None}, fp16 ones as {"value": fp16}. Read from
    the serialized program and blob file, whatever function holds them (each blob is shared)."""
    return dict(iter_package_weights(package))


def iter_package_weights(package: Path) -> Iterator[tuple[str, dict[str, np.ndarray | None]]]:
    """`package_weights` one linear at a time (each once), for packages too big to hold read."""
    import coremltools as ct
    from coremltools.libmilstoragepython import _BlobStorageReader

    spec = ct.utils.load_spec(str(package))
    reader = _BlobStorageReader(str(weight_file(package)))
    seen = set()
    for ops in _functions(spec).values():
        for op in ops:
            name = _strip(_name(op))
            if op.type == INT4_OP and (key := name.removesuffix("_int4")) not in seen:
                args = {k: v.arguments[0].value for k, v in op.inputs.items()}
                seen.add(key)
                yield (
                    key,
                    {
                        "data": read_blob(reader, args["data"]),
                        "scale": read_blob(reader, args["scale"]),
                        "offset": read_blob(reader, args["offset"]) if "offset" in args else None,
                    },
                )
            elif op.type == "const" and name.startswith("owner_") and name.endswith("_weight"):
                value = op.attributes["val"]
                key = name.removeprefix("owner_").removesuffix("_weight")
                if value.HasField("blobFileValue") and key not in seen:
                    seen.add(key)
                    yield key, {"value": read_blob(reader, value)}


def dequantize(entry: dict[str, np.ndarray | None]) -> np.ndarray:
    """scale * (data - offset) per block along the last axis, in float32 (exact: a 4-bit
    integer times an fp16 scale). Core ML materialises this product rounded to fp16."""
    data, scale, offset = entry["data"], entry["scale"], entry["offset"]
    assert data is not None and scale is not None
    q = data.astype(np.float32)
    if offset is not None:
        q = q - np.repeat(offset.astype(np.float32), data.shape[1] // offset.shape[1], axis=1)
    return q * np.repeat(scale.astype(np.float32), data.shape[1] // scale.shape[1], axis=1)


_DTYPES = {1: "bool", 10: "fp16", 11: "fp32", 21: "int8", 22: "int16", 23: "int32", 25: "int4"}
_DTYPES |= {31: "uint8", 32: "uint16", 35: "uint4"}


def validate_mlpackage(package: Path) -> dict[str, Any]:
    """Everything a Linux host can check about a package, as a JSON-ready dict: spec version,
    opset, functions with their inputs/outputs/states (name -> shape, dtype), op counts and
    output dtypes per op type, the stored weight blobs (dtype -> count; total bytes) and
    whether all functions declare the same states. Raises EdgeMTPError if it is not an iOS 18+
    ML program."""
    import coremltools as ct
    from coremltools.proto import FeatureTypes_pb2

    spec = ct.utils.load_spec(str(package))
    if spec.specificationVersion < SPEC_VERSION_IOS18 or not spec.HasField("mlProgram"):
        raise EdgeMTPError(f"{package} is not an iOS 18 ML program; re-export it")
    array = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType

    def desc(features: Any) -> dict[str, Any]:
        out = {}
        for f in features:
            t = (
                f.type.stateType.arrayType
                if f.type.HasField("stateType")
                else f.type.multiArrayType
            )
            out[f.name] = {"shape": list(t.shape), "dtype": array.Name(t.dataType).lower()}
        return out

    functions: dict[str, Any] = {}
    blobs: dict[int, str] = {}
    descriptions = {fd.name: fd for fd in spec.description.functions}
    for name, ops in _functions(spec).items():
        dtypes: dict[str, set[str]] = {}
        for op in ops:
            for v in blob_values([op]):
                dtype = v.type.tensorType.dataType
                blobs[v.blobFileValue.offset] = _DTYPES.get(dtype, str(dtype))
            if op.type != "const" and op.outputs and op.outputs[0].type.HasField("tensorType"):
                dtype = op.outputs[0].type.tensorType.dataType
                dtypes.setdefault(op.type, set()).add(_DTYPES.get(dtype, str(dtype)))
        fd = descriptions[name]
        functions[name] = {
            "inputs": desc(fd.input),
            "outputs": desc(fd.output),
            "states": desc(fd.state),
            "ops": dict(sorted(Counter(op.type for op in ops).items())),
            "dtypes": {k: sorted(v) for k, v in sorted(dtypes.items())},
        }
    states = {json.dumps(f["states"], sort_keys=True) for f in functions.values()}
    weight_bin = weight_file(package)
    return {
        "specification_version": spec.specificationVersion,
        "opset": sorted({fn.opset for fn in spec.mlProgram.functions.values()}),
        "default_function": spec.description.defaultFunctionName,
        "functions": functions,
        "shared_states": len(states) == 1,
        "weight_blobs": dict(sorted(Counter(blobs.values()).items())),
        "weight_bytes": weight_bin.stat().st_size,
    }

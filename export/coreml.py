"""Core ML backend: the static methods as one multifunction ML program (`model.mlpackage`).

The package (ML program, minimum deployment target iOS 18 / macOS 15, spec version 9):

- one function per method (`prefill_intermediate`, `prefill_final`, `verify_0..k`,
  `draft_step`), sharing one copy of the weights (constants de-duplicated across functions);
- the K/V caches are Core ML states (fp16: Core ML has no other state dtype). Every function,
  the drafter included, declares the same states, so on device one `MLState` serves them all;
- the slot positions are NOT states (fp16 holds integers exactly only up to 2048): they are
  int32 inputs `pos_<kind>`, the functions that write the cache return `new_pos_<kind>`, and
  the runner feeds them back. Truncation (implicit rollback), left padding and the trash slot
  are `StaticCache.write`'s;
- every linear with a 4-bit checkpoint form is a `constexpr_blockwise_shift_scale` of OUR codes
  and scales: int4 codes, no offset, for symmetric schemes (Q4_0, symmetric W4A16); uint4 codes
  with uint4 offsets otherwise; one fp16 scale per group along the input dim. coremltools never
  re-derives them: the weight is a custom torch op (`edgemtp::int4_weight`) whose converter
  emits the constexpr from the stored codes. Every other weight is fp16.

The methods (`model/static.py`) are traced with `torch.jit.trace` (coremltools 9's main path;
the drafter's position stays a tensor, which a trace would freeze as an int) in the Core ML form
(`export/forms.py`, `export/coreml_forms.py`) and converted by coremltools' TorchScript frontend
and fp16 pass: everything computes in fp16 but RoPE's angles. Linux checks the package
(`validate_mlpackage`), its weights (`package_weights`) and its numerics (`TorchCoreMLRunner`,
the same form in eager torch); running it (`predict`, macOS 15+), one `MLState` serving every
function, and the compute units' accumulation precision can only be checked on Apple hardware.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import logging
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.coreml_forms import ConstexprInt4Linear, tracing_shapes_only
from edgemtp.export.forms import COREML, COREML_FP16
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.memory import releasing_spilled
from edgemtp.export.weights import int4_of
from edgemtp.model.static import StaticBundle, method_io
from edgemtp.runtime.capabilities import coreml_compute_units
from edgemtp.runtime.runners.coreml import (
    BLOB_KINDS,
    HostPositions,
    blob_values,
    package_weights,
    validate_mlpackage,
    weight_file,
)

PACKAGE = "model.mlpackage"
_UUID_NAMESPACE = uuid.UUID("5d1c6a4e-3f0b-4c1e-9a57-6e6d74704d4c")  # fixed: deterministic ids


def declared_io(static: StaticBundle) -> dict[str, dict[str, list[str]]]:
    """Per function: input names and output names, as the package declares them: the logical
    ones (`model/static.py`'s table), then the slot positions the host keeps."""
    kinds = tuple(static.cache.slots)
    io = {}
    for name in static.methods():
        inputs, outputs = method_io(name)
        writes = [] if name == "draft_step" else [f"new_pos_{k}" for k in kinds]
        io[name] = {
            "inputs": [*inputs, *(f"pos_{k}" for k in kinds)],
            "outputs": [*outputs, *writes],
        }
    return io


# --- conversion -------------------------------------------------------------------------------


_CONVERTERS_REGISTERED = False


def _register_converters() -> None:
    """Teach coremltools 9's TorchScript frontend what our traces contain (once per process):
    the int4 weight op; `__iand__` (the mask code's `m &= ...`), as a logical and; and `int` /
    `bool` of a constant size-1 array, which its own converters pass to `int()` and NumPy >= 2.3
    rejects (the replacements only add that case; they stay registered for the process)."""
    global _CONVERTERS_REGISTERED
    if _CONVERTERS_REGISTERED:
        return
    with _quiet():  # its import warns about untested torch/sklearn versions on stderr
        import coremltools  # noqa: F401
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch import ops
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY
    from coremltools.converters.mil.mil import types as mil_types

    def edgemtp_int4_weight(context: Any, node: Any) -> None:
        codes, scales, zeros = ops._get_inputs(context, node, expected=3)
        c, s, z = codes.val, scales.val, zeros.val
        if c is None or s is None or z is None:
            raise EdgeMTPError(f"int4 weight {node.name}: codes and scales must be constants")
        # the codes as the form stores them (int8), viewed, not copied: a copy would hold
        # every weight of the function once more until it is written
        if not z.any() and c.min() >= -8 and c.max() <= 7:  # symmetric: int4, no offset
            data, offset = c.view(mil_types.np_int4_dtype), None
        else:
            data, offset = c.view(mil_types.np_uint4_dtype), z.astype(mil_types.np_uint4_dtype)
        out = mb.constexpr_blockwise_shift_scale(
            data=data, scale=s.astype(np.float32), offset=offset, name=_int4_name(codes.name)
        )
        context.add(out, torch_name=node.name)

    def edgemtp_iand(context: Any, node: Any) -> None:
        ops.logical_and(context, node)

    def cast_scalar(context: Any, node: Any, dtype: type, dtype_name: str) -> None:
        x = ops._get_inputs(context, node, expected=1)[0]
        if x.can_be_folded_to_const() and not isinstance(x.val, dtype):
            value = dtype(np.asarray(x.val).reshape(()).item())
            context.add(mb.const(val=value, name=node.name), node.name)
        else:
            ops._cast(context, node, dtype, dtype_name)

    def edgemtp_int(context: Any, node: Any) -> None:
        cast_scalar(context, node, int, "int32")

    def edgemtp_bool(context: Any, node: Any) -> None:
        cast_scalar(context, node, bool, "bool")

    _TORCH_OPS_REGISTRY.register_func(edgemtp_int4_weight, ["edgemtp::int4_weight"], False)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_iand, ["iand"], False)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_int, ["int"], True)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_bool, ["bool"], True)
    _CONVERTERS_REGISTERED = True


def _int4_name(codes_var: str) -> str:
    """`<module path>_int4` from the codes' constant name: names the constexpr after its linear
    (`owner.target.layers.0.self_attn.q_proj.int4_codes` -> `target_layers_0_..._q_proj_int4`)."""
    name = codes_var.replace(".", "_").removesuffix("_int4_codes")
    return name.removeprefix("owner_") + "_int4"


_ROPE_CHAIN = ("cast", "expand_dims", "reshape", "mul", "concat")


def _feeds_rope(op: Any, hops: int = 4) -> bool:
    """Whether `op` is a RoPE sin/cos or computes its angle (positions -> float -> * inv_freq
    -> concat -> sin/cos)."""
    if op.op_type in ("sin", "cos"):
        return True
    if hops == 0 or op.op_type not in _ROPE_CHAIN:
        return False
    return any(_feeds_rope(child, hops - 1) for v in op.outputs for child in v.child_ops)


def _fp16_op(op: Any) -> bool:
    """coremltools' fp16 pass op selector: every op computes in fp16 except RoPE's. (Tracing
    in fp16 instead does not work: the TorchScript frontend promotes an fp16 tensor times a
    Python float to fp32, and a promoted weight turns `linear` into `matmul`.)"""
    return not _feeds_rope(op)


def state_names(static: StaticBundle) -> list[str]:
    """The K/V buffers every function declares as states (their names in the traced module)."""
    return [f"owner.kvcache.{kv}{i}" for i in static.cache.owners for kv in "kv"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Mute coremltools' progress bars and warnings (stderr, logging); errors still raise."""
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _converting() -> Iterator[Any]:
    """Quiet, single-validation conversion. coremltools re-validates the whole program after
    each of its passes, a large part of a conversion's time; here validation is off while it
    converts, and the caller validates the result once with the yielded function."""
    with _quiet():
        from coremltools.converters.mil.mil import Program

        validate = Program.validate
        Program.validate = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        try:
            yield validate
        finally:
            Program.validate = validate  # type: ignore[method-assign]


def convert_function(
    name: str, module: nn.Module, inputs: tuple[Tensor, ...], static: StaticBundle
) -> Any:
    """Trace one method (of a bundle in the Core ML form) and convert it to a single-function
    ML program (not compiled: `skip_model_load`, Linux has no Core ML runtime)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    # coremltools names unnamed ops from a process-wide counter that only the end of its own
    # conversions resets (loading a package advances it too): start from zero, so that names,
    # hence bytes, do not depend on what ran before.
    mb.name_count.clear()
    names = declared_io(static)[name]
    cache = static.cache
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation and tracer warnings
        with tracing_shapes_only():
            traced = torch.jit.trace(module, inputs, check_trace=False)
    ct_inputs = [
        ct.TensorType(
            name=n, shape=x.shape, dtype=np.float32 if x.dtype.is_floating_point else np.int32
        )
        for n, x in zip(names["inputs"], inputs, strict=True)
    ]
    states = [
        ct.StateType(
            wrapped_type=ct.TensorType(
                shape=tuple(cache.get_buffer(n.removeprefix("owner.kvcache.")).shape),
                dtype=np.float16,
            ),
            name=n,
        )
        for n in state_names(static)
    ]
    with _converting() as validate:
        model = ct.convert(
            traced,
            inputs=ct_inputs,
            outputs=[ct.TensorType(name=n) for n in names["outputs"]],
            states=states,
            minimum_deployment_target=ct.target.iOS18,
            convert_to="mlprogram",
            compute_precision=ct.transform.FP16ComputePrecision(op_selector=_fp16_op),
            skip_model_load=True,
        )
    validate(model._mil_program)
    return model


def canonicalize(package: Path) -> None:
    """Make a package's bytes a function of its content: the Manifest's random item ids become
    name-derived ones (uuid5), and the model spec is re-serialized with protobuf's
    deterministic map ordering (map fields otherwise serialize in hash order, which changes
    from process to process)."""
    path = package / "Manifest.json"
    manifest = json.loads(path.read_text())
    ids = {
        old: str(uuid.uuid5(_UUID_NAMESPACE, item["path"])).upper()
        for old, item in manifest["itemInfoEntries"].items()
    }
    manifest["itemInfoEntries"] = {ids[k]: v for k, v in manifest["itemInfoEntries"].items()}
    manifest["rootModelIdentifier"] = ids[manifest["rootModelIdentifier"]]
    path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")
    from coremltools.proto import Model_pb2

    spec_path = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    spec_path.write_bytes(spec.SerializeToString(deterministic=True))


class FunctionMerger:
    """One multifunction package, written as single-function packages come (the first
    `verify_0`, else the first added, is the default function): each function's program as
    converted, each weight blob written once for all the functions that store the same bytes.

    coremltools' own merge (`ct.utils.save_multifunction`) holds every function's weights at
    once; this one reads a blob at a time, through a reader opened for it (a reader maps its
    whole file: kept open, what it read would stay resident)."""

    def __init__(self, package: Path):
        from coremltools.libmilstoragepython import _BlobStorageWriter
        from coremltools.proto import Model_pb2

        if package.exists():
            shutil.rmtree(package)
        self.package = package
        weight_file(package).parent.mkdir(parents=True)
        self.writer = _BlobStorageWriter(str(weight_file(package)))
        self.written: dict[tuple[str, bytes], int] = {}
        self.spec = Model_pb2.Model()
        self.manifest = b""

    def add(self, name: str, part: Path) -> None:
        import coremltools as ct
        from coremltools.libmilstoragepython import _BlobStorageReader
        from coremltools.proto import Model_pb2

        spec = ct.utils.load_spec(str(part))
        fn = spec.mlProgram.functions["main"]
        for value in blob_values(fn.block_specializations[fn.opset].operations):
            kind = BLOB_KINDS[value.type.tensorType.dataType]
            reader = _BlobStorageReader(str(weight_file(part)))
            data = getattr(reader, f"read_{kind}_data")(value.blobFileValue.offset)
            del reader
            key = (kind, hashlib.sha256(np.ascontiguousarray(data)).digest())
            if key not in self.written:
                self.written[key] = getattr(self.writer, f"write_{kind}_data")(data)
            value.blobFileValue.offset = self.written[key]
            del data
        if not self.spec.HasField("mlProgram"):
            self.spec.CopyFrom(spec)
            self.spec.mlProgram.ClearField("functions")
            # the functions' descriptions replace the model's; no conversion date (the bytes
            # are a function of the content) nor per-function build info
            for field in ("input", "output", "state", "metadata"):
                self.spec.description.ClearField(field)
            self.spec.mlProgram.ClearField("attributes")
            self.manifest = (part / "Manifest.json").read_bytes()
        self.spec.mlProgram.functions[name].CopyFrom(fn)
        d = spec.description
        self.spec.description.functions.append(
            Model_pb2.FunctionDescription(name=name, input=d.input, output=d.output, state=d.state)
        )

    def finish(self) -> None:
        del self.writer  # closes the blob file
        names = [f.name for f in self.spec.description.functions]
        default = "verify_0" if "verify_0" in names else names[0]
        self.spec.description.defaultFunctionName = default
        spec = self.spec.SerializeToString(deterministic=True)
        (weight_file(self.package).parent.parent / "model.mlmodel").write_bytes(spec)
        (self.package / "Manifest.json").write_bytes(self.manifest)


@contextlib.contextmanager
def _temporary_files_beside(out_dir: Path) -> Iterator[None]:
    """coremltools writes each converted function twice into temporary folders (its blob file,
    then a package): here they go beside the bundle, on the file system the export checked for
    space, and go with the export."""
    work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".edgemtp-coreml."))
    previous, tempfile.tempdir = tempfile.tempdir, str(work)
    try:
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(work, ignore_errors=True)


def _convert_and_merge(
    static: StaticBundle, only: tuple[str, ...] | None, merger: FunctionMerger, progress: Progress
) -> list[str]:
    """Convert each method (those in `only`) and merge it as soon as it is converted; returns
    their names."""
    converted = []
    for name, (module, inputs) in static.methods().items():
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        # coremltools reads the spilled codes a few times over: their pages dropped as it
        # goes, they would all stay resident
        with releasing_spilled():
            model = convert_function(name, module, inputs, static)
            merger.add(name, Path(model.package_path))
            shutil.rmtree(model.package_path)  # coremltools removes its own only at exit
            del model
            gc.collect()
        converted.append(name)
        progress(f"convert {name} ({time.perf_counter() - t0:.1f} s)")
    return converted


def lower_coreml(
    static: StaticBundle,
    delegate: str,
    out_dir: Path,
    progress: Progress,
    only: tuple[str, ...] | None = None,
) -> Lowered:
    """Convert every method of `static` (or those in `only`: tests) into one multifunction
    `model.mlpackage` in `out_dir`; see the module docstring for what it computes."""
    compute_units = coreml_compute_units(delegate)
    _register_converters()

    out_dir = Path(out_dir)
    package = out_dir / PACKAGE
    schemes = int4_schemes(static)
    n_int4 = static.use_form(COREML)["int4"]
    signatures = declared_io(static)
    # each function merged as converted and dropped: one function's weights held at a time
    merger = FunctionMerger(package)
    with _temporary_files_beside(out_dir):
        converted = _convert_and_merge(static, only, merger, progress)
    t0 = time.perf_counter()
    merger.finish()
    canonicalize(package)
    progress(f"save {PACKAGE} ({time.perf_counter() - t0:.1f} s)")
    report = validate_mlpackage(package)
    files = sorted(str(p.relative_to(out_dir)) for p in package.rglob("*") if p.is_file())
    return Lowered(
        files=files,
        program=PACKAGE,
        numerics=numerics(schemes, n_int4),
        details={
            "compute_units": compute_units,  # ct.ComputeUnit, set by the runtime at load
            "int4_linears": n_int4,
            "package": report,
            "unverified_here": (
                "Core ML predict needs macOS 15+: one MLState serving every function (the "
                "drafter reading the target's cache), compute-unit placement and internal "
                "accumulation precision are unchecked on this host"
            ),
        },
        method_io={name: signatures[name] for name in converted},
    )


def int4_schemes(static: StaticBundle) -> list[str]:
    """The 4-bit schemes of the bundle's linears, before a form replaces them."""
    return sorted(
        {
            f"{w.scheme} group {w.group}"
            for m in static.models()
            for x in m.modules()
            if (w := int4_of(x))
        }
    )


def numerics(forms: list[str], n_int4: int) -> dict[str, str]:
    """What the converted program computes (see the module docstring)."""
    weights = "fp16 (rounded from the checkpoint's floats)"
    if n_int4:
        weights = (
            f"{n_int4} linears int4 per block ({', '.join(forms)}) with the checkpoint's codes and "
            "scales as stored (constexpr_blockwise_shift_scale; symmetric: int4, else uint4 with "
            "uint4 offsets; scales fp16, exact: Q4_0's are fp16 by definition and a scale fp16 "
            "cannot hold is refused), dequantized to fp16 (scale * (code - offset), rounded "
            "once); other weights fp16"
        )
    return {
        "weights": weights,
        "activations": "fp16 (fp32 inputs cast to fp16 at entry; float outputs are fp16)",
        "accumulation": "fp16 ops; accumulation inside matmuls/reductions is the compute unit's",
        "cache": "K/V fp16 Core ML states; slot positions int32, host-owned",
        "rope": "angles and sin/cos fp32, then cast to fp16",
        "norm": "RMSNorm in fp16 on x / max|x| (overflow-safe), same function",
    }


# --- runners ----------------------------------------------------------------------------------


class TorchCoreMLRunner(HostPositions):
    """The Core ML form run eagerly in torch behind the package's calling protocol: the
    numerical check a host without Core ML can do. It puts `static` in the form (for good).

    In fp16 (default) it computes what the program computes, up to the compute unit's
    internal accumulation order and precision. In fp32 the same graph must equal the eager
    reference (it proves the form: int4 op, cache writes, host-owned positions, drafter step).
    With `package`, the linears take the weights read back from it: int4 codes, offsets and
    scales in any dtype (the values are exact), fp16 weights in fp16 only (in fp32 they would
    no longer be the reference's)."""

    def __init__(
        self, static: StaticBundle, package: Path | None = None, dtype: torch.dtype = torch.float16
    ):
        static.use_form(COREML_FP16 if dtype == torch.float16 else COREML)
        self.shapes = static.shapes
        self.io = declared_io(static)
        self.dtype = dtype
        self.slot_pos = {k: np.full(n + 1, -1, np.int32) for k, n in static.cache.slots.items()}
        self.methods = {n: m for n, (m, _) in static.methods().items()}
        self.loaded = 0
        if package is not None:
            self.loaded = self._load(static, package_weights(package))

    def reset(self) -> None:
        """Empty the cache (host-owned positions; the K/V values are then never read)."""
        self.slot_pos = {k: np.full_like(p, -1) for k, p in self.slot_pos.items()}

    def _load(self, static: StaticBundle, stored: dict[str, dict[str, Any]]) -> int:
        """Replace the linears' weights by the package's; returns how many were replaced."""
        models = {"target": static.target.target}
        if static.drafter is not None:
            models["drafter"] = static.drafter.drafter
        count = 0
        for prefix, model in models.items():
            for path, module in model.named_modules():
                entry = stored.get(f"{prefix}_{path}".replace(".", "_"))
                if entry is None:
                    continue
                if isinstance(module, ConstexprInt4Linear) and "data" in entry:
                    data = torch.from_numpy(entry["data"].astype(np.int16))
                    offset = entry["offset"]
                    if offset is None:  # signed codes: the unsigned code is data + 8
                        module.int4_codes = (data + 8).to(torch.uint8)
                        module.int4_zeros = torch.full_like(module.int4_zeros, 8)
                    else:
                        module.int4_codes = data.to(torch.uint8)
                        module.int4_zeros = torch.from_numpy(offset.astype(np.uint8))
                    scales = torch.from_numpy(entry["scale"].astype(np.float16))
                    module.int4_scales = scales.to(self.dtype)
                    count += 1
                elif isinstance(module, nn.Linear) and "value" in entry:
                    if self.dtype == torch.float16:
                        module.weight.data = torch.from_numpy(entry["value"].astype(np.float16))
                        count += 1
        return count

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.io[method]
        args = [torch.from_numpy(feeds[n]) for n in names["inputs"]]
        args = [a if a.dtype.is_floating_point else a.long() for a in args]
        with torch.no_grad():
            out = self.methods[method](*args)
        return {n: o.numpy() for n, o in zip(names["outputs"], out, strict=True)}

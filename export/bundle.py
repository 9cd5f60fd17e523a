"""`edgemtp export`: one folder a device runtime needs, described by `manifest.json` (its layout
and reading: `runtime/bundle.py`).

Export writes into a hidden temporary sibling of the output folder and renames it at the end,
so an interrupted or failed export leaves nothing at `--out`. Same inputs give the same bytes:
no timestamps, sorted keys, deterministic programs (each backend tests its own).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgemtp import __version__
from edgemtp.errors import EdgeMTPError
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.memory import (
    GIB,
    MemoryGuard,
    check_estimate,
    estimated_peak,
    linear_elements,
    release_freed_memory,
    spilling,
)
from edgemtp.files import staged_folder
from edgemtp.model.checkpoint import Drafter, Target
from edgemtp.model.config import TextConfig
from edgemtp.model.safetensors_file import TensorEntry, write_tensors
from edgemtp.model.static import StaticBundle, StaticShapes, method_io
from edgemtp.model.tables import Rows, TensorRows, TokenTables
from edgemtp.runtime.bundle import (
    MANIFEST,
    SCHEMA_VERSION,
    TABLES,
    TOKENIZER_FILES,
    check_manifest,
    sha256_file,
)
from edgemtp.runtime.capabilities import check_pair

_TABLE_CHUNK_ROWS = 8192  # rows written at a time: a table is streamed, never whole in memory

# --- host tables -------------------------------------------------------------------------------


def _table_entries(role: str, rows: Rows) -> list[tuple[TensorEntry, Any, str]]:
    """(entry, stored array, format) for one lookup table in the form the checkpoint stores it."""
    from edgemtp.quantize.gguf_import import Q8_0Rows
    from edgemtp.quantize.tables import Int8Rows, Q4_0Rows

    if isinstance(rows, Q4_0Rows | Q8_0Rows):
        fmt = "q4_0" if isinstance(rows, Q4_0Rows) else "q8_0"
        raw = rows.raw
        return [(TensorEntry(f"{role}.{fmt}", "U8", tuple(raw.shape)), raw, fmt)]
    if isinstance(rows, Int8Rows):
        return [
            (TensorEntry(f"{role}.int8", "I8", tuple(rows.values.shape)), rows.values, "int8_row"),
            (TensorEntry(f"{role}.row_scale", "F16", tuple(rows.scales.shape)), rows.scales, ""),
        ]
    if isinstance(rows, TensorRows):
        rows = rows.table
        code = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[rows.dtype]
        return [(TensorEntry(f"{role}.weight", code, tuple(rows.shape)), rows, code.lower())]
    raise EdgeMTPError(f"cannot store a {type(rows).__name__} lookup table in a bundle")


def _as_bytes(chunk: Any) -> np.ndarray:
    if isinstance(chunk, torch.Tensor):
        chunk = chunk.contiguous()
        if chunk.dtype == torch.bfloat16:
            chunk = chunk.view(torch.int16)
        return chunk.numpy()
    return np.asarray(chunk)


def write_tables(
    tables: TokenTables,
    folder: Path,
    progress: Progress,
    release_pages: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write the token (and per-layer) tables as stored into `folder/tables.safetensors`,
    streaming rows; returns the manifest's description of them. `release_pages` runs after each
    chunk: a memory-mapped table would otherwise become resident as it is read."""
    roles = {"token": tables.tokens}
    if tables.per_layer is not None:
        roles["ple"] = tables.per_layer
    stored = [(role, *item) for role, rows in roles.items() for item in _table_entries(role, rows)]
    arrays = {entry.name: array for _, entry, array, _ in stored}

    def produce(entry: TensorEntry) -> Iterator[np.ndarray]:
        array = arrays[entry.name]
        for start in range(0, max(entry.shape[0], 1), _TABLE_CHUNK_ROWS):
            yield _as_bytes(array[start : start + _TABLE_CHUNK_ROWS])
            release_pages()

    tmp = folder / ".tables"
    tmp.mkdir()
    write_tensors(tmp, [e for _, e, _, _ in stored], produce, shard_bytes=2**62, progress=None)
    (tmp / "model.safetensors").rename(folder / TABLES)
    tmp.rmdir()
    out: dict[str, Any] = {}
    for role, rows in roles.items():
        formats = [fmt for r, _, _, fmt in stored if r == role and fmt]
        names = [e.name for r, e, _, _ in stored if r == role]
        out[role] = {"format": formats[0], "shape": list(rows.shape), "tensors": names}
        progress(f"table {role}: {formats[0]} {rows.shape[0]}x{rows.shape[1]}")
    out["file"] = TABLES
    return out


# --- manifest pieces ---------------------------------------------------------------------------


def layer_roles(cfg: TextConfig) -> list[dict[str, Any]]:
    """Each layer's attention kind and KV role: owns its cache, stores one that KV-shared layers
    (and the drafter) read, or reuses a store layer's."""
    return [
        {
            "index": s.index,
            "attention": s.attention,
            "kv": {"own": "owns", "store": "stores", "reuse": "reuses"}[s.kv_role],
            "kv_source": s.kv_source,
            "head_dim": s.head_dim,
            "num_kv_heads": s.num_kv_heads,
            "intermediate_size": s.intermediate_size,
        }
        for s in cfg.layers
    ]


def cache_layout(static: StaticBundle) -> dict[str, Any]:
    """The shared cache buffers: slots per attention kind (full: one per position; sliding: a
    ring of window + max draft + 1), plus one trash slot at the end of each buffer."""
    cache = static.cache
    return {
        "kinds": {
            kind: {"slots": n, "ring": n < static.shapes.max_context, "trash_slot": n}
            for kind, n in cache.slots.items()
        },
        "slot_of_position": "position % slots",
        "buffers": [
            {
                "name": name,
                "shape": list(buf.shape),
                "dtype": str(buf.dtype).removeprefix("torch."),
            }
            for name, buf in cache.named_buffers()
        ],
    }


def _spec(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def method_signatures(static: StaticBundle) -> dict[str, Any]:
    """Every method's inputs and outputs (names, shapes, dtypes), from one call each on the
    example inputs under fake tensors: shapes only, no activations or weights allocated (a
    full-size model's 4-bit linears are not dequantized), the cache left as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = {}
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        for name, (module, inputs) in static.methods().items():
            result = module(*inputs)
            result = result if isinstance(result, tuple) else (result,)
            in_names, out_names = method_io(name)
            out[name] = {
                "inputs": [{"name": n, **_spec(t)} for n, t in zip(in_names, inputs, strict=True)],
                "outputs": [
                    {"name": n, **_spec(t)} for n, t in zip(out_names, result, strict=True)
                ],
            }
    return out


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under `folder` (POSIX relative paths, sorted)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in files
        if p.name != MANIFEST
    }


def copy_tokenizer(target_dir: Path, folder: Path) -> list[str]:
    """Copy the target's tokenizer files that exist (a GGUF file carries none we read)."""
    if not target_dir.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, folder / name)
            copied.append(name)
    return copied


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Add the size and hash of every file in `folder`, check the result against the schema
    and write manifest.json."""
    files = file_table(folder)
    text = json.dumps(dict(manifest, files=files), indent=1, sort_keys=True, allow_nan=False)
    manifest = json.loads(text)  # checked exactly as a reader will see it
    try:
        check_manifest(manifest, folder / MANIFEST)
    except EdgeMTPError as err:
        raise EdgeMTPError(
            f"edgemtp {__version__} wrote a manifest it cannot read: {err}"
        ) from None
    (folder / MANIFEST).write_text(text + "\n")
    return manifest


# --- the export --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportRequest:
    model: Path
    drafter: Path | None
    quant: str  # "auto" (as the checkpoint stores it), "none", "q4_0" or "w4a16"
    backend: str
    delegate: str
    shapes: StaticShapes
    out: Path
    force: bool = False
    activations: str | None = None  # ONNX cpu: "int8" (default) or "fp32"; others: fixed
    kernels: str | None = None  # ExecuTorch cpu: "edgemtp" (default) or "xnnpack"
    # ExecuTorch cpu with a drafter: greedy draft chains `draft_K`, the picks and token lookups
    # in the program (one drafter call per round)
    draft_chains: bool = False
    # bytes: refuse when the estimated peak is over it, stop the export if it holds more
    max_memory: int | None = None
    kv_cache: str | None = None  # the KV cache's dtype (`KV_CACHE_DTYPES`); None: the form's


def _lowerer(backend: str) -> Callable[..., Lowered]:
    if backend == "executorch":
        from edgemtp.export.executorch import lower_executorch

        return lower_executorch
    if backend == "onnx":
        from edgemtp.export.onnx import lower_onnx

        return lower_onnx
    from edgemtp.export.coreml import lower_coreml

    return lower_coreml


def _stored_scheme(path: Path) -> str:
    """ "q4_0", "w4a16", "gguf" or "none": how a checkpoint stores its linear weights."""
    from edgemtp.quantize.checkpoint import QuantizedSource
    from edgemtp.quantize.load import open_checkpoint

    source = open_checkpoint(path)
    if isinstance(source, QuantizedSource):
        return source.settings.get("scheme", "w4a16")
    return "gguf" if path.suffix == ".gguf" else "none"


def _check_requantize(path: Path, quant: str) -> str:
    """The scheme `path` is stored in, refusing a `quant` that would re-quantize it."""
    stored = _stored_scheme(path)
    keeps = quant in ("auto", stored) or (stored == "gguf" and quant == "q4_0")
    if not keeps and stored != "none":
        raise EdgeMTPError(
            f"{path} is stored as {stored}; it cannot be exported as --quant {quant} "
            f"(pre-quantized weights are never re-quantized): pass --quant auto or the float "
            "checkpoint"
        )
    return stored


def _prepare(
    path: Path, quant: str, role: str, scratch: Path, progress: Progress
) -> tuple[Path, str]:
    """The checkpoint to load for `quant`: quantized into `scratch` first when it is float and a
    scheme was asked for; pre-quantized weights are used as they are, never re-quantized."""
    from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint

    stored = _stored_scheme(path)  # `export` refused re-quantizing it before any work
    if quant in ("auto", stored) or (stored == "gguf" and quant == "q4_0"):
        return path, stored
    if quant == "none":
        return path, "none"
    t0 = time.perf_counter()
    out = scratch / role
    quantize_checkpoint(path, out, Settings(scheme=quant, group_size=32))
    progress(f"quantize {role} to {quant}: {time.perf_counter() - t0:.1f} s")
    return out, quant


# Disk a backend's export works in beside its bundle, per linear weight: Core ML's spilled
# codes (1 byte) and, while a converted function is merged, coremltools' blob file and package
# of it and the bundle's package (0.56 each: 4-bit codes and fp16 scales).
WORKING_DISK = {"coreml": 2.7}


def _check_space(
    out: Path, target: Path, drafter: Path | None, backend: str, elements: int
) -> None:
    """Refuse early when the output's file system clearly cannot hold the bundle (about the
    size of the checkpoints, quantized bundles less) and what the export writes beside it."""

    def size(p: Path) -> int:
        return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*"))

    need = (size(target) + (size(drafter) if drafter else 0)) // 2
    need += int(WORKING_DISK.get(backend, 0) * elements)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise EdgeMTPError(
            f"not enough space for {out}: about {need / 2**30:.2f} GiB needed while it is "
            f"written, {free / 2**30:.2f} GiB free on its file system; free space or choose "
            "another --out"
        )


def _check_configs(target: Path, drafter: Path | None) -> None:
    """Fail before any work when the target is not Gemma 4 or the drafter is not its assistant."""
    from edgemtp.model.checkpoint import drafter_config, target_config
    from edgemtp.model.config import check_drafter_matches
    from edgemtp.quantize.load import open_checkpoint

    source = open_checkpoint(target)
    cfg = target_config(source.config, str(source.path))
    if drafter is not None:
        assistant = open_checkpoint(drafter)
        check_drafter_matches(cfg, drafter_config(assistant.config, str(assistant.path)))


def export(req: ExportRequest, progress: Progress) -> dict[str, Any]:
    """Export target (+ drafter) to a bundle at `req.out`; returns the manifest."""
    check_pair(req.backend, req.delegate)
    if req.shapes.context_buckets and (req.backend, req.delegate) != ("executorch", "cpu"):
        raise EdgeMTPError(
            f"context buckets are an ExecuTorch cpu (XNNPACK) option, not {req.backend}/"
            f"{req.delegate}: drop --context-buckets or pass --context-buckets none"
        )
    if req.activations is not None and (req.backend, req.delegate) != ("onnx", "cpu"):
        raise EdgeMTPError(
            f"--activations is an ONNX cpu option, not {req.backend}/{req.delegate} (XNNPACK's "
            "4-bit kernels take int8 activations, Core ML fp16, the HTP calibrated uint16): "
            "drop it"
        )
    if req.kernels is not None and (req.backend, req.delegate) != ("executorch", "cpu"):
        raise EdgeMTPError(
            f"--kernels is an ExecuTorch cpu option, not {req.backend}/{req.delegate} (the "
            "other delegates run their own kernels): drop it"
        )
    if req.kv_cache is not None:
        from edgemtp.export.forms import form_for

        form_for(req.backend, req.delegate, req.kernels or "edgemtp", req.kv_cache)  # refuses
    if req.backend == "executorch" and req.delegate == "htp":
        from edgemtp.export.executorch import qnn_sdk

        qnn_sdk()  # before any work: nothing can be lowered without Qualcomm's SDK
    out = Path(req.out)
    if out.exists() and not (req.force and (out / MANIFEST).is_file()):
        raise EdgeMTPError(f"{out} already exists; choose a new folder or pass --force")
    for p in (req.model, req.drafter):
        if p is not None and not p.exists():
            raise EdgeMTPError(f"{p} does not exist")
    _check_configs(req.model, req.drafter)
    out.parent.mkdir(parents=True, exist_ok=True)
    elements = linear_elements(req.model, req.drafter)
    _check_space(out, req.model, req.drafter, req.backend, elements)
    for p in (req.model, req.drafter):  # every refusal before the estimate's line
        if p is not None:
            _check_requantize(p, req.quant)
    estimate = estimated_peak(req.backend, req.delegate, elements)
    guess = f"{estimate / GIB:.1f} GiB" if estimate is not None else "not measured for this form"
    progress(f"{elements / 1e6:.0f} M linear weights; estimated peak memory {guess}")
    check_estimate(req.max_memory, estimate)
    guard = MemoryGuard(req.max_memory, estimate) if req.max_memory else contextlib.nullcontext()
    scratch = Path(tempfile.mkdtemp(prefix=".edgemtp-quantize.", dir=out.parent))
    try:
        with guard, staged_folder(out) as tmp:
            manifest = _write_bundle(req, tmp, scratch, progress)
    except OSError as err:
        if err.errno == 28:  # ENOSPC
            raise EdgeMTPError(
                f"no space left while writing {out}; nothing was written there: free space or "
                "choose another --out"
            ) from None
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest


def _write_bundle(
    req: ExportRequest, tmp: Path, scratch: Path, progress: Progress
) -> dict[str, Any]:
    """Everything `export` writes, into `tmp` (quantized inputs go to `scratch`)."""
    from edgemtp.export.weights import attach_int4, int4_counts
    from edgemtp.quantize.load import load_drafter, load_target

    stage = time.perf_counter()
    target_path, scheme = _prepare(req.model, req.quant, "target", scratch, progress)
    drafter_path = None
    if req.drafter is not None:
        drafter_path, _ = _prepare(req.drafter, req.quant, "drafter", scratch, progress)
    # Every form but the HTP's replaces the 4-bit linears by their codes: their float weights
    # are never needed whole (the HTP's calibrates activations on the float graph).
    float_4bit = req.delegate == "htp"
    target: Target = load_target(target_path, float_4bit=float_4bit)
    drafter: Drafter | None = (
        load_drafter(drafter_path, target.cfg) if drafter_path is not None else None
    )
    attach_int4(target.model, target.source, target.names)
    if drafter is not None:
        attach_int4(drafter.model, drafter.source, drafter.names)
    progress(f"load: {time.perf_counter() - stage:.1f} s")
    # counted before lowering: a backend's form replaces the linears by its own
    int4_linears = int4_counts(target.model, *([drafter.model] if drafter else []))
    # Greedy draft chains (`draft_K`) where the program runs the picks and the token lookups
    # on the CPU: ExecuTorch's cpu delegate.
    chains = (
        req.draft_chains
        and drafter is not None
        and (req.backend, req.delegate) == ("executorch", "cpu")
    )
    static = StaticBundle.build(
        target.model,
        drafter.model if drafter else None,
        req.shapes,
        embedding=target.tables.token_rows_in_graph() if chains else None,
    )
    stage = time.perf_counter()
    signatures = method_signatures(static)
    progress(f"trace: method signatures {time.perf_counter() - stage:.1f} s")
    extra: dict[str, Any] = {}
    if req.backend == "onnx":  # the tables: the htp delegate calibrates activations on them
        extra = {"tables": target.tables, "activations": req.activations or "int8"}
    elif (req.backend, req.delegate) == ("executorch", "cpu"):
        extra = {"kernels": req.kernels or "edgemtp", "kv_cache": req.kv_cache}
    with spilling(scratch) as spill:  # the weight forms live in files while lowered
        lowered = _lowerer(req.backend)(static, req.delegate, tmp, progress, **extra)
    if spill.bytes:
        progress(f"weights spilled to disk while lowering: {spill.bytes / 2**30:.2f} GiB")
    release_freed_memory()
    stage = time.perf_counter()
    tables = write_tables(target.tables, tmp, progress, target.source.release_pages)
    (tmp / "config.json").write_text(json.dumps(target.cfg.raw, indent=1, sort_keys=True))
    if drafter is not None:
        raw = json.dumps(drafter.cfg.raw, indent=1, sort_keys=True)
        (tmp / "drafter_config.json").write_text(raw)
    tokenizer = copy_tokenizer(Path(req.model), tmp)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "edgemtp_version": __version__,
        "backend": req.backend,
        "delegate": req.delegate,
        "program": lowered.program,
        "shapes": asdict(req.shapes),
        "model": {
            "config": "config.json",
            "hidden_size": target.cfg.hidden_size,
            "vocab_size": target.cfg.vocab_size,
            "num_layers": target.cfg.num_layers,
            "sliding_window": target.cfg.sliding_window,
            "first_shared_layer": target.cfg.first_shared_layer,
            "store_layers": target.cfg.store_layers,
            "eos_token_ids": list(target.cfg.eos_token_ids),
            "bos_token_id": target.cfg.bos_token_id,
            "layers": layer_roles(target.cfg),
        },
        "drafter": None
        if drafter is None
        else {
            "config": "drafter_config.json",
            "num_layers": drafter.cfg.text.num_layers,
            "hidden_size": drafter.cfg.text.hidden_size,
            "clustered_head": drafter.cfg.use_ordered_embeddings,
            "num_centroids": drafter.cfg.num_centroids,
            "centroid_top_k": drafter.cfg.centroid_top_k,
        },
        "cache": cache_layout(static),
        "methods": signatures,
        "method_io": lowered.method_io,
        "quantization": {
            "scheme": scheme,
            "int4_linears": int4_linears,
            "tables": {role: d["format"] for role, d in tables.items() if role != "file"},
        },
        "numerics": lowered.numerics,
        "backend_details": lowered.details,
        "tables": tables,
        "tokenizer": tokenizer,
    }
    manifest = write_manifest(tmp, manifest)
    progress(f"serialize: {time.perf_counter() - stage:.1f} s")
    return manifest

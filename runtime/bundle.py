"""A bundle as the runtime reads it: the manifest (checked against `manifest.schema.json` and,
unless asked not to, every file's size and SHA-256) and the host tables.

    BUNDLE/
      manifest.json          schema, shapes, layer KV roles, cache layout, methods, numerics,
                             quantization, backend/delegate, and size + SHA-256 of every file
      model.pte | onnx/ | model.mlpackage/    the compiled program
      tables.safetensors     token and per-layer embedding tables in their stored (quantized) form,
                             memory-mappable; the runtime gathers rows on the host
      config.json, drafter_config.json         the checkpoints' configs (model shapes, tokens)
      tokenizer.json, ...    the target's tokenizer files, when it has them

`export/bundle.py` writes it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from edgemtp import __version__
from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import KV_CACHE_KINDS, TextConfig
from edgemtp.model.safetensors_file import SafetensorsFile
from edgemtp.model.tables import Rows, TokenTables

SCHEMA_VERSION = 1
SCHEMA = Path(__file__).with_name("manifest.schema.json")
MANIFEST = "manifest.json"
TABLES = "tables.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def open_tables(bundle: Path, cfg: TextConfig, description: dict[str, Any]) -> TokenTables:
    """The bundle's tables, memory-mapped: rows are read and dequantized only when looked up."""
    from edgemtp.quantize.gguf_import import Q8_0Rows
    from edgemtp.quantize.tables import Int8Rows, Q4_0Rows

    file = SafetensorsFile(Path(bundle) / description["file"])
    file.advise_random()

    def rows(role: str) -> Rows:
        d = description[role]
        fmt, cols = d["format"], d["shape"][1]
        if fmt == "q4_0":
            return Q4_0Rows(file.tensor(f"{role}.q4_0").numpy(), cols)
        if fmt == "q8_0":
            return Q8_0Rows(file.tensor(f"{role}.q8_0").numpy(), cols)
        if fmt == "int8_row":
            return Int8Rows(file.tensor(f"{role}.int8"), file.tensor(f"{role}.row_scale"))
        return file.tensor(f"{role}.weight")

    per_layer = rows("ple") if "ple" in description else None
    return TokenTables(rows("token"), per_layer, cfg.num_layers, cfg.hidden_size_per_layer_input)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify_files(bundle: Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists against its size and SHA-256 (and that no file is
    missing); raises naming the first file that differs."""
    bundle = Path(bundle)
    for name, expected in manifest["files"].items():
        path = bundle / name
        if not path.is_file():
            raise EdgeMTPError(f"{bundle}: '{name}' is missing; export the bundle again")
        if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
            raise EdgeMTPError(
                f"{bundle}: '{name}' does not match its SHA-256 in the manifest (corrupt or "
                "modified); export the bundle again"
            )


@functools.cache
def _validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def check_manifest(manifest: Any, path: Path) -> None:
    """Raise one line naming what is wrong with `manifest` (read from or written to `path`):
    a schema version this edgemtp does not read, a field out of `manifest.schema.json`, or a
    file it names that the bundle does not list."""
    import jsonschema

    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        writer = manifest.get("edgemtp_version", "?") if isinstance(manifest, dict) else "?"
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        fix = f"use edgemtp {writer} or newer to run it" if newer else "export the bundle again"
        raise EdgeMTPError(
            f"{path}: manifest schema version {version} (written by edgemtp {writer}); this "
            f"edgemtp {__version__} reads schema version {SCHEMA_VERSION}: {fix}"
        )
    error = jsonschema.exceptions.best_match(_validator().iter_errors(manifest))
    if error is not None:
        field = "/".join(str(part) for part in error.absolute_path) or "(the whole manifest)"
        what = error.message
        if error.validator == "pattern":  # say what the pattern means, not the pattern
            what = f"{error.instance!r:.80} is not {error.schema['description']}"
        raise EdgeMTPError(
            f"{path}: manifest field '{field[:120]}': {what[:160]}; export the bundle again"
        )
    files = manifest["files"]
    named = [manifest["program"], manifest["tables"]["file"], manifest["model"]["config"]]
    named += [manifest["drafter"]["config"]] if manifest["drafter"] else []
    for name in [*named, *manifest["tokenizer"]]:
        if name not in files and not any(f.startswith(name.rstrip("/") + "/") for f in files):
            raise EdgeMTPError(
                f"{path}: the manifest names '{name[:120]}' but lists no such file; export the "
                "bundle again"
            )
    if len(manifest["model"]["layers"]) != manifest["model"]["num_layers"]:
        raise EdgeMTPError(
            f"{path}: the manifest describes {len(manifest['model']['layers'])} layers of a "
            f"{manifest['model']['num_layers']}-layer model; export the bundle again"
        )


def read_manifest(bundle: Path) -> dict[str, Any]:
    """The bundle's manifest, checked against the schema (not yet against the files)."""
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise EdgeMTPError(f"{bundle}: no {MANIFEST} (is this an edgemtp export bundle?)")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, 4300+ digits
        detail = " ".join(str(err).split())[:120] or type(err).__name__
        raise EdgeMTPError(
            f"{path}: corrupt manifest ({detail}); export the bundle again"
        ) from None
    check_manifest(manifest, path)
    return manifest


def kv_cache_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The KV cache a bundle's programs keep: its dtype (`KV_CACHE_KINDS`' names) and bytes
    (every K/V buffer, trash slots included; an int8 cache's row scales too), from the
    manifest's cache buffers."""
    import math

    import numpy as np

    buffers = [b for b in manifest["cache"]["buffers"] if b["name"][0] in "kv"]
    kinds = {KV_CACHE_KIND_OF.get(b["dtype"], b["dtype"]) for b in buffers}
    nbytes = sum(math.prod(b["shape"]) * np.dtype(b["dtype"]).itemsize for b in buffers)
    return {"dtype": "/".join(sorted(kinds)), "bytes": int(nbytes)}


KV_CACHE_KIND_OF = dict(zip(("float32", "float16", "int8"), KV_CACHE_KINDS, strict=True))

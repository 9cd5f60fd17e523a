"""edgemtp's quantized checkpoint layout: write one from a float checkpoint, read it (and
compressed-tensors "pack-quantized" checkpoints) back as a TensorSource.

Layout: a Hugging Face folder (config.json, safetensors, tokenizer files copied along). The config
gains `"edgemtp_quantization": {"version", "scheme", "group_size", "symmetric", "method",
"embeddings", "ple"}`. Linear weights `<m>.weight` are stored as
  - q4_0:  `<m>.weight_q4_0`  uint8 [out, in/32*18]   (GGML Q4_0 blocks, bit-exact)
  - w4a16: `<m>.weight_packed` int32 [out, in/8], `<m>.weight_scale` [out, in/group],
           `<m>.weight_shape` int64 [2], `<m>.weight_zero_point` (asymmetric only) — the
           compressed-tensors pack-quantized layout, with its `quantization_config`, so other
           compressed-tensors readers load the linear layers too.
The lookup tables follow `embeddings` (the token table, also the tied LM head; the assistant's
tied head) and `ple` (the per-layer table): q4_0 as above, int8 as `<m>.weight_int8` int8 +
`<m>.weight_row_scale` fp16 [rows], or fp16 as `<m>.weight`. Everything else (norms, scalars,
token ordering) is stored as it was.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder
from edgemtp.model.checkpoint import TensorSource
from edgemtp.model.config import read_config_json
from edgemtp.model.safetensors_file import TensorEntry, write_tensors
from edgemtp.model.tables import Rows
from edgemtp.quantize.q4_0 import (
    BLOCK,
    BLOCK_BYTES,
    Q4_0,
    dequantize_q4_0,
    pack_q4_0,
    quantize_q4_0,
    unpack_q4_0,
)
from edgemtp.quantize.tables import Int8Rows, Q4_0Rows, quantize_int8_rows
from edgemtp.quantize.w4a16 import (
    W4A16,
    PackQuantizedConfig,
    dequantize_w4a16,
    parse_quantization_config,
    quantize_w4a16,
    read_pack_quantized,
    to_pack_quantized,
)

SCHEMES = ("q4_0", "w4a16")
EMBEDDINGS = ("q4_0", "int8", "fp16")
TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
LAYOUT_VERSION = 1
_TABLE_CHUNK_ROWS = 8192
_ST_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def is_table(name: str) -> bool:
    return name.endswith(TABLES)


def is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and not is_table(name)


# --- reading -----------------------------------------------------------------------------------


def stores_quantized(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a quantized checkpoint (edgemtp's or compressed-tensors')."""
    return "quantization_config" in config or "edgemtp_quantization" in config


class QuantizedSource(TensorSource):
    """A folder in edgemtp's quantized layout or a compressed-tensors pack-quantized checkpoint;
    weights are served under their float names and dequantized on request."""

    def __init__(self, path: Path, config: dict[str, Any]):
        super().__init__(path, config)
        self.settings = config.get("edgemtp_quantization") or {}
        if self.settings and self.settings.get("version") != LAYOUT_VERSION:
            raise EdgeMTPError(
                f"{path}: edgemtp_quantization version {self.settings.get('version')} is not "
                f"supported (this edgemtp reads version {LAYOUT_VERSION}); re-quantize"
            )
        self.packed: PackQuantizedConfig | None = None
        if "quantization_config" in config:
            self.packed = parse_quantization_config(config["quantization_config"])

    def _stored(self, name: str, suffix: str) -> str:
        return name[: -len("weight")] + suffix

    def names(self) -> list[str]:
        out = []
        for stored in self.where:
            base, _, suffix = stored.rpartition(".")
            if suffix in ("weight_q4_0", "weight_int8", "weight_packed"):
                out.append(base + ".weight")
            elif suffix not in ("weight_row_scale", *_PACKED_SUFFIXES):
                out.append(stored)
        return out

    def quantized(self, name: str) -> Q4_0 | W4A16 | None:
        """The stored quantized form of a weight (never re-quantized), or None if float."""
        q4 = self._stored(name, "weight_q4_0")
        if q4 in self.where:
            raw = self.raw(q4)
            cols = raw.shape[1] // BLOCK_BYTES * BLOCK
            return unpack_q4_0(raw.numpy(), (raw.shape[0], cols), name)
        packed = self._stored(name, "weight_packed")
        if packed in self.where:
            if self.packed is None:
                raise EdgeMTPError(f"{self.path}: '{packed}' without a quantization_config")
            module = name.removesuffix(".weight")
            scheme = self.packed.scheme_for(module)
            if scheme is None:
                raise EdgeMTPError(
                    f"{self.path}: '{packed}' is packed but no quantization_config group targets "
                    f"'{module}'"
                )
            tensors = {
                s: self.raw(self._stored(name, s))
                for s in _PACKED_SUFFIXES
                if self._stored(name, s) in self.where
            }
            return read_pack_quantized(tensors, scheme, name)
        return None

    def scheme_4bit(self, name: str) -> str | None:
        if self._stored(name, "weight_q4_0") in self.where:
            return "q4_0"
        return "w4a16" if self._stored(name, "weight_packed") in self.where else None

    def shape_4bit(self, name: str) -> tuple[int, int] | None:
        q4 = self._stored(name, "weight_q4_0")
        if q4 in self.where:
            rows, row_bytes = self.where[q4].shape(q4)
            return rows, row_bytes // BLOCK_BYTES * BLOCK
        if self._stored(name, "weight_packed") not in self.where:
            return None
        shape = self._stored(name, "weight_shape")
        if shape in self.where:
            out_features, in_features = (int(n) for n in self.raw(shape).reshape(-1))
            return out_features, in_features
        return self.quantized(name).shape  # type: ignore[union-attr]

    def tensor(self, name: str) -> torch.Tensor:
        q = self.quantized(name)
        if isinstance(q, Q4_0):
            return dequantize_q4_0(q)
        if isinstance(q, W4A16):
            return dequantize_w4a16(q)
        int8 = self._stored(name, "weight_int8")
        if int8 in self.where:
            rows = self.table(name)
            return rows[torch.arange(rows.shape[0])]
        return self.raw(name)

    def table(self, name: str) -> Rows:
        q4 = self._stored(name, "weight_q4_0")
        if q4 in self.where:
            raw = self.raw(q4)
            return Q4_0Rows(raw, raw.shape[1] // BLOCK_BYTES * BLOCK)
        int8 = self._stored(name, "weight_int8")
        if int8 in self.where:
            return Int8Rows(self.raw(int8), self.raw(self._stored(name, "weight_row_scale")))
        return self.tensor(name)


# --- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    scheme: str = "q4_0"
    group_size: int = 32
    symmetric: bool = True
    method: str = "rtn"
    embeddings: str = "q4_0"  # the token table, which is also the tied LM head
    ple: str = "int8"  # the per-layer embedding table (2.35 B of E2B's 4.6 B parameters)
    scale_dtype: torch.dtype = torch.bfloat16

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise EdgeMTPError(f"unknown scheme '{self.scheme}' (choose from {', '.join(SCHEMES)})")
        for flag, value in (("--embeddings", self.embeddings), ("--ple", self.ple)):
            if value not in EMBEDDINGS:
                raise EdgeMTPError(
                    f"unknown {flag} '{value}' (choose from {', '.join(EMBEDDINGS)})"
                )
        if self.scheme == "q4_0" and (self.group_size != 32 or not self.symmetric):
            raise EdgeMTPError(
                "q4_0 is symmetric with groups of 32 by definition; drop --group/--asymmetric"
            )
        if self.group_size <= 0:
            raise EdgeMTPError(f"--group must be positive, got {self.group_size}")
        if self.method not in ("rtn", "gptq"):
            raise EdgeMTPError(f"unknown method '{self.method}' (choose rtn or gptq)")
        if self.method == "gptq" and self.scheme != "w4a16":
            raise EdgeMTPError(
                "--method gptq applies to w4a16 (q4_0 is defined by GGML's rounding)"
            )


def _kind(name: str, shape: tuple[int, ...], settings: Settings) -> str:
    if name.endswith("embed_tokens_per_layer.weight"):
        return settings.ple
    if is_table(name):
        return settings.embeddings
    if is_linear(name, shape):
        return settings.scheme
    return "keep"


def _entries(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str, settings: Settings
) -> list[TensorEntry]:
    base = name[: -len("weight")]
    rows, cols = shape if len(shape) == 2 else (0, 0)
    if kind == "q4_0":
        return [TensorEntry(base + "weight_q4_0", "U8", (rows, cols // BLOCK * BLOCK_BYTES))]
    if kind == "int8":
        return [
            TensorEntry(base + "weight_int8", "I8", (rows, cols)),
            TensorEntry(base + "weight_row_scale", "F16", (rows,)),
        ]
    if kind == "fp16":
        return [TensorEntry(name, "F16", shape)]
    if kind == "w4a16":
        groups = cols // settings.group_size
        out = [
            TensorEntry(base + "weight_packed", "I32", (rows, math.ceil(cols / 8))),
            TensorEntry(base + "weight_scale", _ST_DTYPE[settings.scale_dtype], (rows, groups)),
            TensorEntry(base + "weight_shape", "I64", (2,)),
        ]
        if not settings.symmetric:
            out.append(
                TensorEntry(base + "weight_zero_point", "I32", (math.ceil(rows / 8), groups))
            )
        return out
    return [TensorEntry(name, _ST_DTYPE[dtype], shape)]


def _fits(shape: tuple[int, ...], kind: str, settings: Settings) -> bool:
    group = BLOCK if kind == "q4_0" else settings.group_size if kind == "w4a16" else 1
    return shape[-1] % group == 0


def compressed_tensors_config(settings: Settings, ignore: list[str]) -> dict[str, Any]:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": settings.symmetric,
        "strategy": "group",
        "group_size": settings.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def quantize_checkpoint(
    model: Path,
    out: Path,
    settings: Settings,
    hessians: dict[str, torch.Tensor] | None = None,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Quantize a float checkpoint folder into edgemtp's layout at `out`; returns a summary.

    Written to a temporary sibling folder and renamed at the end: an interrupted or failed run
    leaves nothing at `out`.
    """
    settings.validate()
    say = progress or (lambda _msg: None)
    out = Path(out)
    if out.exists() and not (overwrite and (out / "config.json").is_file()):
        raise EdgeMTPError(f"{out} already exists; choose a new folder or pass --force")
    config = None if Path(model).suffix == ".gguf" else read_config_json(Path(model))
    if config is None or stores_quantized(config):
        raise EdgeMTPError(
            f"{model} is already quantized; quantize the float checkpoint (pre-quantized weights "
            "are imported as they are, never re-quantized)"
        )
    source = TensorSource(Path(model), config)
    t0 = time.perf_counter()
    plan = []
    for name in source.names():
        raw = source.raw(name)
        kind = _kind(name, tuple(raw.shape), settings)
        if not _fits(tuple(raw.shape), kind, settings):
            kind = "fp16"  # as llama.cpp does for rows that are not a multiple of the block
        plan.append((name, tuple(raw.shape), raw.dtype, kind))
    entries = [
        e for name, shape, dt, kind in plan for e in _entries(name, shape, dt, kind, settings)
    ]
    owner = {
        e.name: (name, kind)
        for name, shape, dt, kind in plan
        for e in _entries(name, shape, dt, kind, settings)
    }
    cache: dict[str, dict[str, torch.Tensor]] = {}
    row_scales: dict[str, list[torch.Tensor]] = {}
    errors: dict[str, list[float]] = {}

    def produce(entry: TensorEntry) -> Iterator[np.ndarray]:
        name, kind = owner[entry.name]
        w = source.raw(name)
        if kind == "keep":
            yield _bytes(w)
        elif kind == "w4a16":
            if name not in cache:
                cache.clear()
                cache[name] = _w4a16_tensors(name, w, settings, hessians, errors)
            yield _bytes(cache[name][entry.name.rpartition(".")[2]])
        elif entry.name.endswith("weight_row_scale"):  # computed with the int8 values before it
            yield torch.cat(row_scales.pop(name)).numpy()
        else:  # q4_0 / int8 / fp16, row chunks so a 2 GiB table never sits in memory as fp32
            for start in range(0, w.shape[0], _TABLE_CHUNK_ROWS):
                rows = source.raw_rows(name, start, start + _TABLE_CHUNK_ROWS).float()
                if kind == "q4_0":
                    q = quantize_q4_0(rows, name)
                    yield pack_q4_0(q)
                    _track_error(errors, name, rows, dequantize_q4_0(q), start)
                elif kind == "int8":
                    values, scales = quantize_int8_rows(rows)
                    yield values.numpy()
                    row_scales.setdefault(name, []).append(scales)
                    _track_error(
                        errors, name, rows, values.float() * scales.float()[:, None], start
                    )
                else:
                    half = rows.half()
                    yield half.numpy()
                    _track_error(errors, name, rows, half.float(), start)

    config = dict(source.config)
    config["edgemtp_quantization"] = {
        "version": LAYOUT_VERSION,
        "scheme": settings.scheme,
        "group_size": settings.group_size,
        "symmetric": settings.symmetric,
        "method": settings.method,
        "embeddings": settings.embeddings,
        "ple": settings.ple,
    }
    if settings.scheme == "w4a16":
        ignore = ["lm_head"] + [
            name.removesuffix(".weight")
            for name, _, _, kind in plan
            if kind not in ("w4a16", "keep")
        ]
        config["quantization_config"] = compressed_tensors_config(settings, ignore)
    with staged_folder(out) as tmp:
        write_tensors(tmp, entries, produce, progress=say)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in sorted(Path(model).iterdir()):
            if extra.suffix in (".json", ".model", ".jinja", ".txt") and extra.name not in (
                "config.json",
                "model.safetensors.index.json",
            ):
                shutil.copy2(extra, tmp / extra.name)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    return {
        "seconds": time.perf_counter() - t0,
        "bytes": size,
        "kept_fp16": [n for n, _, _, kind in plan if kind == "fp16" and not is_table(n)],
        "weight_rel_error": relative_rms_errors(errors),
    }


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as numpy sees them (numpy has no bfloat16)."""
    return t.contiguous().view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _w4a16_tensors(
    name: str,
    w: torch.Tensor,
    settings: Settings,
    hessians: dict[str, torch.Tensor] | None,
    errors: dict[str, list[float]],
) -> dict[str, torch.Tensor]:
    module = name.removeprefix("model.").removesuffix(".weight")
    if settings.method == "gptq":
        from edgemtp.quantize.gptq import gptq_quantize

        h = (hessians or {}).get(module)
        if h is None:
            q = quantize_w4a16(
                w.float(), settings.group_size, settings.symmetric, settings.scale_dtype, name
            )
        else:
            q = gptq_quantize(
                w.float(),
                h,
                settings.group_size,
                settings.symmetric,
                settings.scale_dtype,
                name=name,
            )
    else:
        q = quantize_w4a16(
            w.float(), settings.group_size, settings.symmetric, settings.scale_dtype, name
        )
    _track_error(errors, name, w.float(), dequantize_w4a16(q), 0)
    return to_pack_quantized(q)


def _track_error(
    errors: dict[str, list[float]], name: str, w: torch.Tensor, wq: torch.Tensor, start: int
) -> None:
    """Accumulate [squared error, squared norm] per tensor over its row chunks."""
    if start == 0:
        errors[name] = [0.0, 0.0]
    errors[name][0] += float((w - wq).double().pow(2).sum())
    errors[name][1] += float(w.double().pow(2).sum())


def relative_rms_errors(errors: dict[str, list[float]]) -> dict[str, float]:
    """||W - Wq|| / ||W|| per tensor."""
    return {name: math.sqrt(err / max(norm, 1e-30)) for name, (err, norm) in errors.items()}

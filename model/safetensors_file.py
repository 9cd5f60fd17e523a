"""A bounds-checked, memory-mapped safetensors reader.

Tensors are views of a copy-on-write mapping of the file: nothing is read until a row is touched,
so the embedding tables stay on disk except for the rows a prompt uses. Every header field is
checked against the file before any tensor is made.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgemtp.errors import EdgeMTPError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                if size < 8:
                    raise EdgeMTPError(f"{self.path}: truncated safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise EdgeMTPError(
                        f"{self.path}: corrupt or truncated safetensors header "
                        f"(declares {header_len} header bytes, file has {size})"
                    )
                raw = f.read(header_len)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except OSError as err:
            raise EdgeMTPError(f"{self.path}: cannot read ({err.strerror})") from None
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EdgeMTPError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise EdgeMTPError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self._entries[name] = self._check_entry(name, info, data_len)

    def _check_entry(
        self, name: str, info: object, data_len: int
    ) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        bad = f"{self.path}: corrupt safetensors entry '{name}'"
        if not isinstance(info, dict):
            raise EdgeMTPError(bad)
        name_of_dtype = info.get("dtype")
        dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        if dtype is None:
            raise EdgeMTPError(f"{bad}: unsupported dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
        ):
            raise EdgeMTPError(f"{bad}: malformed shape or offsets")
        begin, end = offsets
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end or end - begin != nbytes:
            raise EdgeMTPError(f"{bad}: offsets {offsets} do not fit shape {shape}")
        if end > data_len:
            raise EdgeMTPError(
                f"{self.path}: truncated: tensor '{name}' ends at byte {end} of the data, "
                f"file holds {data_len}; re-download or re-export the checkpoint"
            )
        return dtype, tuple(shape), begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor, read into fresh memory (no mapping left resident):
        for streaming through tables larger than the memory one wants to use."""
        dtype, shape, begin, _ = self._entries[name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        stop = min(stop, shape[0])
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin + start * row_bytes)
            data = bytearray(f.read((stop - start) * row_bytes))
        return torch.frombuffer(data, dtype=dtype).view(stop - start, *shape[1:])

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory: they stay in the page
        cache, and a later read maps them again. An export that has streamed through a
        checkpoint would otherwise count all of it as resident."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):  # not on Windows
            self._map.madvise(mmap.MADV_DONTNEED)

    def advise_random(self) -> None:
        """Tell the kernel rows are read at random (lookup tables): no read-ahead around each
        touched row, so resident memory follows the rows looked up."""
        if self._map is not None and hasattr(mmap, "MADV_RANDOM"):  # not on Windows
            self._map.madvise(mmap.MADV_RANDOM)

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of the mapped file (pages load on first touch)."""
        dtype, shape, begin, end = self._entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self._map,
            dtype=dtype,
            count=(end - begin) // dtype.itemsize,
            offset=self._data_start + begin,
        )
        return flat.view(shape)


# --- writing, one tensor at a time -----------------------------------------------------------

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
DEFAULT_SHARD_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to be written: its safetensors dtype code and shape, data produced later."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def header_bytes(entries: list[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def plan_shards(entries: list[TensorEntry], shard_bytes: int) -> list[list[TensorEntry]]:
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_tensors(
    folder: Path,
    entries: list[TensorEntry],
    produce: Callable[[TensorEntry], Iterable[np.ndarray]],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write `model.safetensors` (or HF-style shards plus an index) into `folder`, streaming:
    the header first, then each tensor's bytes as `produce(entry)` yields them."""
    shards = plan_shards(entries, shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for k, (file_name, shard) in enumerate(zip(names, shards, strict=True), start=1):
        if progress:
            size = sum(e.nbytes for e in shard) / 2**20
            progress(f"[{k}/{len(shards)}] {file_name}: {len(shard)} tensors, {size:.1f} MiB")
        with open(folder / file_name, "wb") as f:
            f.write(header_bytes(shard))
            for e in shard:
                written = 0
                for chunk in produce(e):
                    data = np.ascontiguousarray(chunk)
                    f.write(memoryview(data).cast("B"))
                    written += data.nbytes
                if written != e.nbytes:
                    raise ValueError(f"{e.name}: produced {written} bytes, expected {e.nbytes}")
                if progress:
                    progress(f"{e.name} {'x'.join(map(str, e.shape))} {e.dtype}")
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: n for n, s in zip(names, shards, strict=True) for e in s},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

"""An export's memory: the peak it expects before it starts, the guard that stops it with one
clear line (nothing written) before the operating system would kill it, and the spill that keeps
weight forms in files, not in anonymous memory, while a program is lowered.

The estimate counts what scales with the model: the elements of its linears, the weights every
program holds in 4 bits (`linear_elements`), priced per element by what an export of that
backend form was measured to hold at its peak (benchmarks/README.md, "Exporting in bounded
memory"), plus what the libraries themselves take.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.checkpoint import drafter_config, target_config
from edgemtp.model.gemma4 import Gemma4Drafter, Gemma4Target
from edgemtp.quantize.load import open_checkpoint
from edgemtp.runtime.capabilities import COREML_COMPUTE_UNITS
from edgemtp.runtime.probes import current_rss_mb

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class PeakModel:
    """peak = base + per_element * linear elements, for one backend form."""

    base: float  # bytes: Python, torch, the exporter's libraries, a small model's graphs
    per_element: float  # bytes per linear weight element at the export's peak


# Each a line through the peaks of two measured exports (benchmarks/README.md, "Exporting in
# bounded memory"). ExecuTorch cpu: the full-size E2B preset with its assistant, 2357 M linear
# weights, 3.15 GiB, and PEER-90M, 64 M, 1.06 GiB. ONNX cpu: E2B at half scale, 537 M, 1.96 GiB,
# and E4B, 6138 M, 8.22 GiB. Core ML (one conversion for every delegate: the compute units are
# chosen at load): E2B, 2.63 GiB, and E4B, 4.44 GiB. Forms not measured have none.
PEAK_MODELS: dict[tuple[str, str], PeakModel] = {
    ("executorch", "cpu"): PeakModel(base=1.00 * GIB, per_element=0.98),
    ("onnx", "cpu"): PeakModel(base=1.36 * GIB, per_element=1.20),
    **{("coreml", d): PeakModel(base=1.50 * GIB, per_element=0.51) for d in COREML_COMPUTE_UNITS},
}


def linear_elements(model: Path, drafter: Path | None) -> int:
    """Weights of the target's (and the drafter's) linears, from the configs alone: the models
    are built on the meta device, nothing is read or allocated."""
    target = open_checkpoint(model)
    cfg = target_config(target.config, str(target.path))
    with torch.device("meta"):
        modules: list[nn.Module] = [Gemma4Target(cfg)]
        if drafter is not None:
            assistant = open_checkpoint(drafter)
            assistant_cfg = drafter_config(assistant.config, str(assistant.path))
            modules.append(Gemma4Drafter(assistant_cfg, cfg))
    return sum(
        m.weight.numel() for root in modules for m in root.modules() if isinstance(m, nn.Linear)
    )


def estimated_peak(backend: str, delegate: str, elements: int) -> int | None:
    """Bytes an export is expected to hold at its peak; None where no export of this form was
    measured."""
    fit = PEAK_MODELS.get((backend, delegate))
    return None if fit is None else round(fit.base + fit.per_element * elements)


class MemoryGuard:
    """While active, samples this process's resident memory; past `limit` bytes it interrupts
    the main thread, and the export stops with one line (its staged folder removed) instead of
    being killed by the OS later. A long native call is stopped when it returns to Python."""

    def __init__(self, limit: int, estimate: int | None, interval: float = 0.2):
        self.limit, self.estimate, self.interval = limit, estimate, interval
        self.tripped: float | None = None  # resident MiB when the guard fired
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            rss = current_rss_mb()
            if rss is not None and rss * MIB > self.limit:
                self.tripped = rss
                _thread.interrupt_main()
                return

    def __enter__(self) -> MemoryGuard:
        if current_rss_mb() is not None:  # nothing to watch where memory cannot be read
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.tripped is not None and kind is KeyboardInterrupt:
            expected = (
                f"; its estimated peak was {self.estimate / GIB:.1f} GiB" if self.estimate else ""
            )
            raise EdgeMTPError(
                f"export stopped: it held {self.tripped * MIB / GIB:.1f} GiB, over --max-memory "
                f"{self.limit / GIB:.1f} GiB{expected}; nothing was written (raise --max-memory "
                "or export on a machine with more memory)"
            ) from None


def release_freed_memory() -> None:
    """Hand memory the program has freed back to the OS. glibc keeps freed blocks below its
    (self-raising) mmap threshold in the heap, where a weight conversion's many temporaries
    otherwise stay resident for the rest of the export. Elsewhere, nothing to do."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class Spill:
    """Weights moved out of anonymous memory into unlinked files under `folder`, mapped back in
    place: the programs keep their tensors, but their pages are the page cache's, which the
    kernel writes back and drops under pressure, and `release` takes them out of this process's
    resident set (MADV_DONTNEED) once a stage has read them. What an export's weight forms would
    otherwise hold at once (1.7 bytes a weight for the ExecuTorch cpu form) then costs disk, not
    memory; the files vanish with the process."""

    MIN_BYTES = MIB  # smaller tensors are not worth a mapping each

    def __init__(self, folder: Path):
        self.folder = folder
        # weakly: a tensor replaced later (a linear fused into another) takes its mapping,
        # and its file's blocks, with it
        self.maps: list[weakref.ref[mmap.mmap]] = []
        self.bytes = 0

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A file-backed copy of `t` (itself when small or a view)."""
        n = t.untyped_storage().nbytes()
        whole = t.is_contiguous() and not t.storage_offset() and t.numel() * t.element_size() == n
        if n < self.MIN_BYTES or not whole:
            return t
        fd, path = tempfile.mkstemp(dir=self.folder, prefix=".spill-")
        try:
            os.unlink(path)
            os.ftruncate(fd, n)
            mapped = mmap.mmap(fd, n)
        finally:
            os.close(fd)
        out = torch.frombuffer(mapped, dtype=t.dtype, count=t.numel()).view(t.shape)
        out.copy_(t)
        mapped.madvise(mmap.MADV_DONTNEED)
        self.maps.append(weakref.ref(mapped))
        self.bytes += n
        return out

    def module(self, module: torch.nn.Module) -> None:
        """Spill every parameter and buffer of `module` in place."""
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for t in table.values():
                    if t is None:
                        continue
                    spilled = self.tensor(t.data)
                    if spilled is not t.data:
                        t.data = spilled

    def release(self) -> None:
        live = [(ref, m) for ref in self.maps if (m := ref()) is not None]
        for _, mapped in live:
            mapped.madvise(mmap.MADV_DONTNEED)
        self.maps = [ref for ref, _ in live]


def zero_weight(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [rows, cols] tensor of zeros that takes no memory: untouched private anonymous pages,
    which reads map to the kernel's one zero page (shared ones would each get a page). A
    stand-in for a weight while a program is traced: the values it computes are never read."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    pages = mmap.mmap(-1, rows * cols * dtype.itemsize, flags=flags)
    return torch.frombuffer(pages, dtype=dtype).view(rows, cols)


_spill: Spill | None = None


@contextlib.contextmanager
def spilling(folder: Path) -> Iterator[Spill]:
    """While active, `spill_module` moves weight forms to files under `folder` and
    `release_spilled` drops their resident pages."""
    global _spill
    previous, _spill = _spill, Spill(folder)
    try:
        yield _spill
    finally:
        _spill = previous


def spill_module(module: torch.nn.Module) -> None:
    """Spill `module`'s weights if an export is spilling (`spilling`), then release what was
    read of the spilled ones and the heap its temporaries took: blocks under glibc's mmap
    threshold (32 MiB), freed one linear after another, otherwise stay resident."""
    if _spill is not None:
        _spill.module(module)
        release_spilled()


def spill_data(data: Any) -> Any:
    """`data` (bytes a delegate packed, to be written into the program) moved to a file
    ExecuTorch's serializer copies from (its `FileBackedData`), if an export is spilling."""
    if _spill is None or not isinstance(data, bytes) or len(data) < Spill.MIN_BYTES:
        return data
    from executorch.exir._serialize._cord import FileBackedData

    fd, path = tempfile.mkstemp(dir=_spill.folder, prefix=".spill-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    _spill.bytes += len(data)
    return FileBackedData(path, cleanup=True)


def release_spilled() -> None:
    """Drop the spilled weights' pages from resident memory, and freed heap with them."""
    if _spill is not None:
        _spill.release()
    release_freed_memory()


@contextlib.contextmanager
def releasing_spilled(interval: float = 0.5) -> Iterator[None]:
    """`release_spilled` every `interval` seconds from a thread while the block runs: for a
    library call that reads every spilled weight once (ExecuTorch's emitter copies each
    constant into the program), whose read pages would otherwise all stay resident. Safe
    beside readers: the mappings are shared file mappings, a dropped page is read again."""
    if _spill is None:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            _spill.release()  # type: ignore[union-attr]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        release_spilled()


def check_estimate(limit: int | None, estimate: int | None) -> None:
    """Refuse before any work when the estimate is over `limit`."""
    if limit is not None and estimate is not None and estimate > limit:
        raise EdgeMTPError(
            f"this export is estimated to peak at {estimate / GIB:.1f} GiB, over --max-memory "
            f"{limit / GIB:.1f} GiB; nothing was done (raise --max-memory, or export on a "
            "machine with more memory)"
        )

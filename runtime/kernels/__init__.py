"""edgemtp's own ExecuTorch kernels, compiled when the package installs.

`cache_attention.cpp` (attention of a few rows over the static cache, reading only the slots
some row attends to), `q4_0_linear.cpp` (GGML Q4_0 linears as llama.cpp computes them) and
`rms_norm.cpp` (the norms and RoPE between them) implement the `edgemtp::` operators that
`ops.py` declares, with the numerics each must reproduce. The Q4_0 linear's arithmetic is
`q4_0.h`, plain C++ without ExecuTorch (its tests build it alone, for arm64 under qemu too).

ExecuTorch's Python runtime finds a kernel in the registry of its `libexecutorch.so`; a shared
library linked to that same file registers its kernels there when it is loaded. `setup.py`
builds the library for each ISA variant (`native.py`); `load()` loads the one this CPU runs
best, after the runtime's own libraries, and a program that calls `edgemtp::` operators loads
only after that. The apps compile the same sources into their native libraries
(apps/core/executorch/executorch.cmake).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

from edgemtp import native
from edgemtp.errors import EdgeMTPError

FOLDER = Path(__file__).resolve().parent
INSTEAD = ", or export the bundle with --kernels xnnpack"
ISA_VARIABLE = "EDGEMTP_KERNELS_ISA"
REINSTALL = "install edgemtp again with a C++17 compiler on PATH (pip install -e . in a checkout)"


def executorch_root() -> Path:
    import executorch

    return Path(executorch.__path__[0])


def library_path(variant: native.Variant | None = None) -> Path:
    """The installed library of `variant` (this CPU's by default), checked against the sources
    beside it (an editable install whose kernels were edited since it was built)."""
    path = FOLDER / native.KERNELS.file_name(variant or chosen_variant())
    if not path.is_file():
        raise EdgeMTPError(
            f"{path.name} is missing: edgemtp's kernels were not built when it was installed; "
            f"{REINSTALL}{INSTEAD}"
        )
    built = FOLDER / native.DIGEST
    if not built.is_file() or built.read_text().strip() != native.source_digest(native.KERNELS):
        raise EdgeMTPError(
            f"edgemtp's kernel sources in {FOLDER} changed since they were built: {REINSTALL}"
        )
    return path


def chosen_variant() -> native.Variant:
    """This CPU's widest variant, or the one `EDGEMTP_KERNELS_ISA` names (a narrower one, to
    measure or test it on a wider CPU)."""
    named = os.environ.get(ISA_VARIABLE)
    if not named:
        return native.chosen_variant()
    by_name = {v.name: v for v in native.variants()}
    if named not in by_name:
        raise EdgeMTPError(f"{ISA_VARIABLE}={named}: not one of {', '.join(by_name)}")
    variant, features = by_name[named], native.cpu_features()
    if not variant.requires <= features:
        lacking = ", ".join(sorted(variant.requires - features))
        raise EdgeMTPError(f"{ISA_VARIABLE}={named}: this CPU lacks {lacking}; unset it")
    return variant


def load_library(path: Path) -> None:
    """Load a kernel library into the ExecuTorch runtime's registry. It needs libexecutorch by
    its name: load the runtime's own copy first (the one its Python bindings use)."""
    lib = executorch_root() / "lib"
    for name in ("libexecutorch.so", "libexecutorch_threadpool.so"):
        ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


@cache
def load() -> Path:
    """Load this CPU's kernels into ExecuTorch's registry (once per process)."""
    path = library_path()
    load_library(path)
    return path


@cache
def unavailable() -> str | None:
    """Why the kernels cannot be loaded here, or None when they can (asked once per process:
    every runner asks)."""
    try:
        load()
    except (EdgeMTPError, OSError) as e:
        return str(e)
    return None

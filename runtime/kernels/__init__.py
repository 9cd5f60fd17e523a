"""edgemtp's own ExecuTorch kernels, built on this machine against the installed runtime.

`cache_attention.cpp` (attention of a few rows over the static cache, reading only the slots
some row attends to), `q4_0_linear.cpp` (GGML Q4_0 linears as llama.cpp computes them) and
`rms_norm.cpp` (the norms and RoPE between them) implement the `edgemtp::` operators that
`ops.py` declares, with the numerics each must reproduce. The Q4_0 linear's arithmetic is
`q4_0.h`, plain C++ without ExecuTorch (its tests build it alone, for arm64 under qemu too).

ExecuTorch's Python runtime finds a kernel in the registry of its `libexecutorch.so`; a shared
library linked to that same file registers its kernels there when it is loaded. So `load()`
compiles the sources once per key (`native.py`: the sources, compiler, this CPU and the
ExecuTorch installation) into `~/.cache/edgemtp/kernels/` and loads the result; a program that
calls `edgemtp::` operators loads only after that. The apps' C++ core compiles the same sources
into its runner (apps/core/tests/executorch.cmake).
"""

from __future__ import annotations

import ctypes
from functools import cache
from importlib import metadata
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.native import BUILD_CACHE, NATIVE_FLAGS, compiled

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cache_attention.cpp", "q4_0_linear.cpp", "rms_norm.cpp")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("exp_poly.h", "parallel.h", "q4_0.h"))
LIBRARY = "libedgemtp_kernels.so"
C10_HEADERS = "include/executorch/runtime/core/portable_type/c10"  # the c10 ExecuTorch vendors
# what ExecuTorch's CMake package asks consumers for
FLAGS = (*NATIVE_FLAGS, "-DC10_USING_CUSTOM_GENERATED_MACROS")
INSTEAD = ", or export the bundle with --kernels xnnpack"


def executorch_root() -> Path:
    import executorch

    return Path(executorch.__path__[0])


def build(cache_dir: Path = BUILD_CACHE, flags: tuple[str, ...] = FLAGS) -> Path:
    """The kernels' shared library, compiled first when this key has none yet. `flags`: this
    machine's by default (the tests also build for narrower vector targets)."""
    lib_dir = executorch_root() / "lib"
    link = (f"-L{lib_dir}", "-lexecutorch", "-lexecutorch_threadpool", f"-Wl,-rpath,{lib_dir}")
    include = (f"-I{executorch_root() / 'include'}", f"-I{executorch_root() / C10_HEADERS}")
    arguments = (*include, *map(str, SOURCES), *link)
    return compiled(
        LIBRARY, SOURCES, HEADERS, arguments,
        flags=flags, cache_dir=cache_dir, key=installation(), fix=INSTEAD,
    )  # fmt: skip


def installation() -> tuple[str, str]:
    """The ExecuTorch installation the library links to (part of its build key): loaded beside
    another copy's libexecutorch.so (a second venv sharing the build cache) it would give the
    process two kernel registries, and abort."""
    return metadata.version("executorch"), str(executorch_root().resolve())


@cache
def load() -> Path:
    """Build if needed and load the kernels into ExecuTorch's registry (once per process)."""
    library = build()
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return library


@cache
def unavailable() -> str | None:
    """Why the kernels cannot be built here, or None when they can (asked once per process:
    every runner asks, and a failing compiler would otherwise run again for each)."""
    try:
        load()
    except (EdgeMTPError, OSError) as e:
        return str(e)
    return None

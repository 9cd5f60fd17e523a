"""edgemtp's own ExecuTorch kernels, built on this machine against the installed runtime.

`cache_attention.cpp` is `edgemtp::cache_attention.out`: attention of a few rows over the
static KV cache that reads only the slots the mask lets some row attend to (see the file), and
`cache_attention_rows.out`, the same written as the output projection reads it.
`q4_0_linear.cpp` is `edgemtp::q4_0_linear.out`: a few rows times a GGML Q4_0 weight as
llama.cpp computes it (Q8_0 activations, signed block scales), and `q4_0_gated_linear.out`,
the same for the input gelu_tanh(gate) * up.
`rms_norm.cpp` is `edgemtp::rms_norm.out` and `edgemtp::add_rms_norm.out`: the norms between
those kernels, and the residual add after one, so no XNNPACK delegate call runs between two;
and `edgemtp::head_norm_rope.out`, the q/k/v heads of a projection normed and rotated.
ExecuTorch's Python runtime finds a kernel in the registry of its `libexecutorch.so`; a shared
library linked to that same file registers its kernels there when it is loaded. So `load()`
compiles the sources once per source, compiler and ExecuTorch installation into
`~/.cache/edgemtp/kernels/<hash>/` (written to a temporary folder, then renamed) and loads the
result; a program that calls `edgemtp::` operators loads only after that. The apps' C++ core
compiles the same sources into its runner (apps/core/tests/executorch.cmake).
`table_rows.cpp` is not an ExecuTorch kernel: the host's lookups of Q4_0 / Q8_0 table rows in
one C call (`table_rows()`, through ctypes), built the same way into its own small library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cache_attention.cpp", "q4_0_linear.cpp", "rms_norm.cpp")
)
TABLE_ROWS_SOURCE = Path(__file__).with_name("table_rows.cpp")
TABLE_ROWS_LIBRARY = "libedgemtp_table_rows.so"
HEADERS = tuple(Path(__file__).with_name(name) for name in ("exp_poly.h", "parallel.h"))
CACHE_ATTENTION = "edgemtp::cache_attention.out"  # as a program (and a manifest) names it
CACHE_ATTENTION_ROWS = "edgemtp::cache_attention_rows.out"  # bundles since the gated kernel
Q4_0_LINEAR = "edgemtp::q4_0_linear.out"
Q4_0_GATED_LINEAR = "edgemtp::q4_0_gated_linear.out"
RMS_NORM = "edgemtp::rms_norm.out"
ADD_RMS_NORM = "edgemtp::add_rms_norm.out"
HEAD_NORM_ROPE = "edgemtp::head_norm_rope.out"
BUILD_CACHE = Path.home() / ".cache" / "edgemtp" / "kernels"
LIBRARY = "libedgemtp_kernels.so"
C10_HEADERS = "include/executorch/runtime/core/portable_type/c10"  # the c10 ExecuTorch vendors
FLAGS = (
    "-O3",
    *(  # built where it runs: this machine's vector width (AVX-512's full width where it has it)
        ("-march=native", "-mprefer-vector-width=512")
        if platform.machine().lower() in ("x86_64", "amd64")
        else ("-mcpu=native",)
    ),
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-DC10_USING_CUSTOM_GENERATED_MACROS",  # what ExecuTorch's CMake package asks consumers for
)


def executorch_root() -> Path:
    import executorch

    return Path(executorch.__path__[0])


def compiler() -> str | None:
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return shutil.which("g++") or shutil.which("clang++")


def _build_key(
    cxx: str, flags: tuple[str, ...] = FLAGS, sources: tuple[Path, ...] = (*SOURCES, *HEADERS)
) -> str:
    """Sources, compiler, flags and the very ExecuTorch installation: the library links to
    that one's libexecutorch.so, and loading it beside another copy (a second venv sharing
    this cache) would give the process two kernel registries, and abort."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    root = str(executorch_root().resolve())
    for part in (version, metadata.version("executorch"), root, " ".join(flags)):
        digest.update(part.encode())
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def build(cache_dir: Path = BUILD_CACHE, flags: tuple[str, ...] = FLAGS) -> Path:
    """The kernels' shared library, compiled first when this key has none yet. `flags`: this
    machine's by default (the tests also build for narrower vector targets)."""
    lib_dir = executorch_root() / "lib"
    link = (f"-L{lib_dir}", "-lexecutorch", "-lexecutorch_threadpool", f"-Wl,-rpath,{lib_dir}")
    include = (f"-I{executorch_root() / 'include'}", f"-I{executorch_root() / C10_HEADERS}")
    arguments = (*include, *map(str, SOURCES), *link)
    return _compiled(LIBRARY, SOURCES, HEADERS, arguments, cache_dir, flags)


def _compiled(
    library_name: str,
    sources: tuple[Path, ...],
    headers: tuple[Path, ...],
    arguments: tuple[str, ...],
    cache_dir: Path,
    flags: tuple[str, ...],
) -> Path:
    cxx = compiler()
    if cxx is None:
        named = os.environ.get("CXX")
        found = f"CXX={named} was not found" if named else "none was found (g++, clang++)"
        raise EdgeMTPError(
            f"edgemtp's ExecuTorch kernels are compiled on this machine and need a C++17 "
            f"compiler; {found}: install g++ (apt install g++) or set CXX, or export the "
            "bundle with --attention matmul"
        )
    folder = cache_dir / _build_key(cxx, flags, (*sources, *headers))
    library = folder / library_name
    if library.exists():
        return library
    with staged_folder(folder) as tmp:
        command = [cxx, *flags, *arguments, "-o", str(tmp / library_name)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            first = next((line for line in lines if "error" in line), lines[-1] if lines else "")
            raise EdgeMTPError(
                f"compiling edgemtp's ExecuTorch kernels failed ({cxx}): {first or 'no output'}; "
                "set CXX to a C++17 compiler, or export the bundle with --attention matmul"
            )
    return library


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


@cache
def table_rows() -> ctypes.CDLL | None:
    """The table-row library (`table_rows.cpp`) loaded, or None where it cannot be built (no
    compiler): the lookups then run in numpy, to the same values."""
    try:
        source = (TABLE_ROWS_SOURCE,)
        arguments = tuple(map(str, source))
        path = _compiled(TABLE_ROWS_LIBRARY, source, (), arguments, BUILD_CACHE, FLAGS)
        library = ctypes.CDLL(str(path))
    except (EdgeMTPError, OSError):
        return None
    for name in ("edgemtp_q4_0_rows", "edgemtp_q8_0_rows"):
        function = getattr(library, name)
        function.argtypes = [
            ctypes.c_void_p,  # table
            ctypes.c_int64,  # its rows
            ctypes.c_void_p,  # ids (int64)
            ctypes.c_int64,  # how many
            ctypes.c_int64,  # columns
            ctypes.c_float,  # scale
            ctypes.c_void_p,  # out (float32 [n, columns])
        ]
        function.restype = ctypes.c_int64
    return library

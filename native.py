"""edgemtp's native libraries: what each is built from, for which CPUs, and which one runs here.

They are compiled when the package installs (`setup.py` calls `build_all`), so running a
bundle needs no compiler. A library whose code depends on the vector ISA is built once per
variant: on x86 one per ISA level (baseline x86-64, AVX2 + FMA + F16C, AVX-512 with VNNI),
chosen at run time from what this CPU and OS support, since a library built for a wider ISA can
die with SIGILL on load; on arm64 one library that picks its NEON dotprod / i8mm paths itself
(HWCAP, sysctl). A digest of the sources is written beside them: an editable install whose
sources changed since it was built says so instead of running stale code.

Only the standard library is imported here: `setup.py` loads this file before edgemtp or its
dependencies are importable.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Variant:
    """One build of a library for a set of CPUs: `flags` for the compiler, `requires` the CPU
    features (Linux /proc/cpuinfo names) it may use."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str] = frozenset()


X86_VARIANTS = (  # widest first: the first this CPU supports runs
    Variant(
        "x86-64-v4-vnni",
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic", "-mprefer-vector-width=512"),
        frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}),
    ),
    Variant(
        "x86-64-v3",
        ("-march=x86-64-v3", "-mtune=generic"),
        frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    ),
    Variant("x86-64", ("-march=x86-64", "-mtune=generic")),
)
ARM64_VARIANTS = (Variant("arm64", ()),)  # dotprod / i8mm chosen inside (q4_0.h)


@dataclass(frozen=True)
class Library:
    """A shared library built from `sources` (relative to the package root); `executorch`: it
    holds ExecuTorch kernels and links to the installed runtime's libexecutorch."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    executorch: bool
    per_isa: bool  # one build per Variant, or one baseline build

    @property
    def folder(self) -> str:
        return str(Path(self.sources[0]).parent)

    def file_name(self, variant: Variant | None) -> str:
        return f"lib{self.name}.{variant.name}.so" if variant else f"lib{self.name}.so"


KERNELS = Library(
    "edgemtp_kernels",
    tuple(f"runtime/kernels/{n}.cpp" for n in ("cache_attention", "q4_0_linear", "rms_norm")),
    tuple(f"runtime/kernels/{n}.h" for n in ("cache_attention", "exp_poly", "parallel", "q4_0")),
    executorch=True,
    per_isa=True,
)
TABLE_ROWS = Library(
    "edgemtp_table_rows", ("quantize/table_rows.cpp",), (), executorch=False, per_isa=False
)
LIBRARIES = (KERNELS, TABLE_ROWS)
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC")
C10_HEADERS = "include/executorch/runtime/core/portable_type/c10"  # the c10 ExecuTorch vendors
DIGEST = "sources.sha256"


def machine() -> str:
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def variants(machine_name: str | None = None) -> tuple[Variant, ...]:
    machine_name = machine_name or machine()
    if machine_name == "x86_64":
        return X86_VARIANTS
    if machine_name == "aarch64":
        return ARM64_VARIANTS
    return (Variant(machine_name, ()),)  # another architecture: its compiler's default


def source_digest(library: Library, root: Path = PACKAGE_ROOT) -> str:
    digest = hashlib.sha256()
    for path in (*library.sources, *library.headers):
        digest.update(path.encode() + b"\0" + (root / path).read_bytes())
    return digest.hexdigest()


def cpu_features() -> frozenset[str]:
    """This CPU's features as the OS reports them (the kernel leaves out what it does not
    save across context switches, such as AVX-512 state where it is off)."""
    if sys.platform.startswith("linux"):
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
        for line in text.splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
        return frozenset()
    if sys.platform == "darwin" and machine() == "x86_64":
        names = ("machdep.cpu.features", "machdep.cpu.leaf7_features")
        done = subprocess.run(["sysctl", "-n", *names], capture_output=True, text=True)
        words = done.stdout.lower().replace(".", "_").split()
        renamed = {"avx1_0": "avx", "avx512vnni": "avx512_vnni"}
        return frozenset(renamed.get(w, w) for w in words)
    return frozenset()


def chosen_variant(features: frozenset[str] | None = None) -> Variant:
    """The widest variant whose features this CPU has."""
    features = cpu_features() if features is None else features
    return next(v for v in variants() if v.requires <= features)


# --- building (setup.py, at install) ---------------------------------------------------------


class BuildError(RuntimeError):
    pass


def compiler() -> str:
    named = os.environ.get("CXX")
    found = shutil.which(named) if named else shutil.which("g++") or shutil.which("clang++")
    if not found:
        why = f"CXX={named} was not found" if named else "none was found (g++, clang++)"
        raise BuildError(
            f"edgemtp's kernels are compiled when it installs and need a C++17 compiler; {why}: "
            "install g++ (apt install g++) or set CXX, then install edgemtp again"
        )
    return found


def build_all(out_root: Path, executorch_root: Path | None, root: Path = PACKAGE_ROOT) -> None:
    """Every library, every variant, written under `out_root` (the package's folders), each
    compiled from its sources under `root`. `executorch_root`: the installed `executorch`
    package whose headers the kernels compile against (None: skip the ExecuTorch libraries)."""
    cxx = compiler()
    libraries = [lib for lib in LIBRARIES if executorch_root is not None or not lib.executorch]
    jobs = [
        (library, variant)
        for library in libraries
        for variant in (variants() if library.per_isa else (None,))
    ]
    _say(f"compiling {len(jobs)} native libraries with {cxx}")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: _build(cxx, *job, out_root, executorch_root, root), jobs))
    for library in libraries:
        (out_root / library.folder / DIGEST).write_text(source_digest(library, root) + "\n")


def _say(text: str) -> None:
    print(f"edgemtp: {text}", file=sys.stderr, flush=True)


def _build(
    cxx: str,
    library: Library,
    variant: Variant | None,
    out_root: Path,
    executorch_root: Path | None,
    root: Path,
) -> None:
    arguments = [*COMMON_FLAGS, *(variant.flags if variant else ()), "-shared"]
    if library.executorch:
        assert executorch_root is not None
        arguments += [
            "-DC10_USING_CUSTOM_GENERATED_MACROS",  # what ExecuTorch's CMake package asks for
            f"-I{executorch_root / 'include'}",
            f"-I{executorch_root / C10_HEADERS}",
        ]
    arguments += [str(root / s) for s in library.sources]
    if library.executorch:
        # Linked by soname, with no run path: loading it finds the libexecutorch.so that the
        # ExecuTorch runtime already loaded, so its kernels go into that runtime's registry.
        arguments += [f"-L{executorch_root / 'lib'}", "-lexecutorch", "-lexecutorch_threadpool"]
        if sys.platform == "darwin":
            arguments += ["-undefined", "dynamic_lookup"]
    target = out_root / library.folder / library.file_name(variant)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    done = subprocess.run([cxx, *arguments, "-o", str(partial)], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = done.stderr.strip().splitlines()
        first = next((line for line in lines if "error" in line), lines[-1] if lines else "")
        raise BuildError(f"compiling {target.name} failed ({cxx}): {first or 'no output'}")
    os.replace(partial, target)
    _say(f"built {target.name}")

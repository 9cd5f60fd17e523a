"""Building edgemtp's C++ sources on the machine that runs them, once per key, into a cache.

The key is everything the library depends on: the sources, the compiler (its path and
version), the flags, what `-march=native` resolves to on this CPU (a library built for one CPU
can die with SIGILL on another that shares the cache folder) and whatever the caller adds (the
ExecuTorch installation a kernel library links to). A build is written to a temporary folder
and renamed, so a failed or interrupted one leaves nothing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder

BUILD_CACHE = Path.home() / ".cache" / "edgemtp" / "kernels"
NATIVE_FLAGS = (
    "-O3",
    *(  # built where it runs: this machine's vector width (AVX-512's full width where it has it)
        ("-march=native", "-mprefer-vector-width=512")
        if platform.machine().lower() in ("x86_64", "amd64")
        else ("-mcpu=native",)
    ),
    "-std=c++17",
    "-shared",
    "-fPIC",
)


def compiler() -> str | None:
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return shutil.which("g++") or shutil.which("clang++")


def resolved_target(cxx: str, flags: tuple[str, ...]) -> str:
    """What the compiler makes of `flags` on this machine (`-###`: the driver's command for its
    compiler proper, `-march=native` spelled out as the CPU's name and features)."""
    driver = subprocess.run(
        [cxx, *flags, "-###", "-E", "-x", "c++", "-"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    lines = [line for line in driver.stderr.splitlines() if "march" in line or "target-cpu" in line]
    return platform.machine() + "\n" + "\n".join(lines)


def build_key(
    cxx: str, flags: tuple[str, ...], files: tuple[Path, ...], extra: tuple[str, ...]
) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    parts = (
        str(Path(cxx).resolve()),
        version,
        resolved_target(cxx, flags),
        " ".join(flags),
        *extra,
    )
    for part in parts:
        digest.update(part.encode())
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def compiled(
    library_name: str,
    sources: tuple[Path, ...],
    headers: tuple[Path, ...],
    arguments: tuple[str, ...],
    *,
    flags: tuple[str, ...] = NATIVE_FLAGS,
    cache_dir: Path = BUILD_CACHE,
    key: tuple[str, ...] = (),
    fix: str = "",
) -> Path:
    """The shared library `library_name` built from `sources` (with `arguments`: include
    paths, the sources, link flags), compiled first when its key has none yet. `fix`: what the
    user can do instead when no compiler works, for the error line."""
    cxx = compiler()
    if cxx is None:
        named = os.environ.get("CXX")
        found = f"CXX={named} was not found" if named else "none was found (g++, clang++)"
        raise EdgeMTPError(
            f"edgemtp's kernels are compiled on this machine and need a C++17 compiler; "
            f"{found}: install g++ (apt install g++) or set CXX{fix}"
        )
    folder = cache_dir / build_key(cxx, flags, (*sources, *headers), key)
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
                f"compiling edgemtp's kernels failed ({cxx}): {first or 'no output'}; set CXX "
                f"to a C++17 compiler{fix}"
            )
    return library

"""Builds edgemtp's native libraries when the package installs (the rest is pyproject.toml).

The kernels compile against the `executorch` wheel's headers, which the build environment
installs (pyproject.toml's build-system requires the same version the package runs with). An
editable install writes the libraries beside their sources; a wheel holds them in place.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _native():
    spec = importlib.util.spec_from_file_location("edgemtp_native", HERE / "native.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """The libraries are plain shared libraries (ctypes loads them), not Python extensions;
    built in build_ext, whose failure fails the install (an editable install ignores a failing
    customised build_py)."""

    def run(self) -> None:
        import executorch

        native = _native()
        out = HERE if self.editable_mode else Path(self.build_lib) / "edgemtp"
        try:
            native.build_all(out, Path(executorch.__path__[0]), HERE)
        except native.BuildError as e:
            raise SystemExit(f"error: {e}") from None


class BuildPy(build_py):
    """The package's root is the repository's: leave this file out of the package."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if Path(m[2]).resolve() != Path(__file__).resolve()]


class BinaryDistribution(Distribution):
    """The wheel holds native code: tag it for this platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPy, "build_ext": BuildNative}, distclass=BinaryDistribution)

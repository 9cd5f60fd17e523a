"""Which delegates each backend has, which of them a host can run, and why a bundle cannot run
here.

`why_not(backend, delegate)` answers "can a bundle of this backend and delegate run on this host,
and if not, why": None, or one line naming the missing OS, package or SDK and what to do. The
host is described by a `Host` (detected, or built by hand to ask about another machine).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from edgemtp.errors import EdgeMTPError

BACKENDS = ("executorch", "coreml", "onnx")
DELEGATES = ("cpu", "metal", "npu", "htp")
# Which delegates each backend can target, and what to do instead when it cannot.
SUPPORTED = {
    "executorch": {"cpu": "XNNPACK", "metal": "Core ML", "npu": "Core ML", "htp": "QNN"},
    "coreml": {"cpu": "CPU_ONLY", "metal": "CPU_AND_GPU", "npu": "CPU_AND_NE"},
    "onnx": {"cpu": "CPU EP", "htp": "QNN EP (QDQ)"},
}


def check_pair(backend: str, delegate: str) -> None:
    if backend not in SUPPORTED:
        raise EdgeMTPError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if delegate not in SUPPORTED[backend]:
        others = [b for b in BACKENDS if delegate in SUPPORTED[b]]
        where = "no backend has it"
        if others:
            where = f"for {delegate} use --backend {' or '.join(others)}"
        raise EdgeMTPError(
            f"--backend {backend} has no '{delegate}' delegate (it has "
            f"{', '.join(SUPPORTED[backend])}); {where}"
        )


# Core ML's compute units per delegate: the Core ML backend's and ExecuTorch's Core ML delegate's.
COREML_COMPUTE_UNITS = SUPPORTED["coreml"]


def coreml_compute_units(delegate: str) -> str:
    """The `ct.ComputeUnit` name a delegate maps to (set by the runtime when it loads)."""
    if delegate == "htp":
        raise EdgeMTPError(
            "Core ML has no Qualcomm delegate; use --backend executorch or onnx with --delegate htp"
        )
    if delegate not in COREML_COMPUTE_UNITS:
        raise EdgeMTPError(
            f"unknown delegate '{delegate}' for Core ML (choose {', '.join(COREML_COMPUTE_UNITS)})"
        )
    return COREML_COMPUTE_UNITS[delegate]


EXECUTORCH_BACKENDS = {"cpu": "XnnpackBackend", "metal": "CoreMLBackend", "npu": "CoreMLBackend"}
EXECUTORCH_BACKENDS["htp"] = "QnnBackend"
ONNX_PROVIDERS = {"cpu": "CPUExecutionProvider", "htp": "QNNExecutionProvider"}
QNN_HTP_LIBRARY = "libQnnHtp.so"
ARM64 = ("aarch64", "arm64", "ARM64")


@dataclass(frozen=True)
class Host:
    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine()
    mac_version: str = ""  # "15.1" on macOS
    executorch_backends: tuple[str, ...] | None = None  # None: executorch not installed
    onnx_providers: tuple[str, ...] | None = None  # None: onnxruntime not installed
    coremltools: bool = False
    qnn_libraries: bool = False  # libQnnHtp.so found (QNN_SDK_ROOT or the library path)

    @classmethod
    def detect(cls, backend: str | None = None) -> Host:
        """This machine, with the runtimes installed in this Python; with `backend`, only the
        runtime that backend needs is probed (importing ExecuTorch is slow and noisy)."""
        wants = {backend} if backend else {"executorch", "onnx", "coreml"}
        return cls(
            system=platform.system(),
            machine=platform.machine(),
            mac_version=platform.mac_ver()[0],
            executorch_backends=_executorch_backends() if "executorch" in wants else None,
            onnx_providers=_onnx_providers() if "onnx" in wants else None,
            coremltools=_importable("coremltools") if "coreml" in wants else False,
            qnn_libraries=_qnn_libraries(),
        )


def macos_missing(system: str, version: str, what: str = "running a Core ML bundle") -> str | None:
    """Why `what` (which needs macOS 15+) cannot happen on this OS, or None."""
    if system != "Darwin":
        return f"{what} needs macOS 15+ (this host is {system or 'unknown'})"
    if int(version.split(".")[0] or 0) < 15:
        return f"{what} needs macOS 15+ (this host is macOS {version}); update macOS"
    return None


def why_not(backend: str, delegate: str, host: Host | None = None) -> str | None:
    """None when a `backend` bundle for `delegate` can run on `host` (default: this one),
    else one line saying what is missing and what to do."""
    if backend not in SUPPORTED:
        check_pair(backend, delegate)  # raises: unknown backend
    try:
        check_pair(backend, delegate)
    except EdgeMTPError as e:
        return str(e)
    host = host or Host.detect(backend)
    if backend == "executorch":
        return _executorch(delegate, host)
    if backend == "onnx":
        return _onnx(delegate, host)
    if backend == "coreml":
        missing = macos_missing(host.system, host.mac_version)
        if missing:
            return f"{missing}: run it on a Mac, or export --backend executorch/onnx"
        if not host.coremltools:
            return "running a Core ML bundle needs coremltools: pip install coremltools"
        return None
    raise AssertionError(backend)  # SUPPORTED names no other backend


def require(backend: str, delegate: str, host: Host | None = None) -> None:
    """Raise EdgeMTPError with `why_not`'s line when the bundle cannot run here."""
    why = why_not(backend, delegate, host)
    if why is not None:
        raise EdgeMTPError(why)


def _executorch(delegate: str, host: Host) -> str | None:
    backend = EXECUTORCH_BACKENDS[delegate]
    if host.executorch_backends is None:
        return "running an ExecuTorch bundle needs executorch: pip install executorch==1.5.1"
    if delegate in ("metal", "npu"):
        missing = macos_missing(host.system, host.mac_version, "ExecuTorch's Core ML delegate")
        if missing:
            return f"{missing} or iOS 18+: run the bundle there, or export --delegate cpu"
    if delegate == "htp":
        if host.system == "Darwin" or host.machine not in ARM64:
            return (
                f"the QNN HTP delegate runs on a Snapdragon device (this host is {host.system} "
                f"{host.machine}): run the bundle on the phone (apps/android), or export "
                "--delegate cpu"
            )
        if not host.qnn_libraries:
            return (
                f"the QNN HTP delegate needs Qualcomm's runtime libraries ({QNN_HTP_LIBRARY}): "
                "install the Qualcomm AI Engine Direct SDK and set QNN_SDK_ROOT"
            )
    if backend not in host.executorch_backends:
        return (
            f"this executorch build has no {backend} (it has "
            f"{', '.join(host.executorch_backends) or 'none'}): install a build with it"
        )
    return None


def _onnx(delegate: str, host: Host) -> str | None:
    provider = ONNX_PROVIDERS[delegate]
    if host.onnx_providers is None:
        return "running an ONNX bundle needs onnxruntime: pip install onnxruntime"
    if provider not in host.onnx_providers:
        return (
            f"this onnxruntime has no {provider} (it has {', '.join(host.onnx_providers)}): "
            "on Windows on Snapdragon pip install onnxruntime-qnn; on Android use ONNX Runtime's "
            "QNN-enabled package (apps/android)"
        )
    return None


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def _executorch_backends() -> tuple[str, ...] | None:
    if not _importable("executorch"):
        return None
    try:
        from executorch.runtime import Runtime
    except ImportError:
        return None
    registry = Runtime.get().backend_registry
    return tuple(sorted(b for b in registry.registered_backend_names if registry.is_available(b)))


def _onnx_providers() -> tuple[str, ...] | None:
    if not _importable("onnxruntime"):
        return None
    import onnxruntime

    return tuple(onnxruntime.get_available_providers())


def _qnn_libraries() -> bool:
    root = os.environ.get("QNN_SDK_ROOT")
    if root and any(Path(root).glob(f"lib/*/{QNN_HTP_LIBRARY}")):
        return True
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    return any((Path(p) / QNN_HTP_LIBRARY).is_file() for p in paths if p)

"""Runs a bundle's ExecuTorch program with ExecuTorch's Python runtime."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes


class ExecuTorchRunner:
    """Runs the methods of a .pte with ExecuTorch's Python runtime (XNNPACK and portable
    kernels on this host; a program delegated to Core ML or QNN needs that backend's runtime).

    edgemtp's own kernels (`runtime/kernels`) are built and loaded first; a program that calls
    them and a machine that cannot build them get one line naming the fix.

    XNNPACK's weight cache is switched on before loading, so methods that share a weight
    (every target method shares all of them) share one packed copy instead of packing it again
    for each method. `threads`: XNNPACK's thread pool size (None: as is).
    The option is process-wide: `weight_cache=False` only helps before any program loaded."""

    def __init__(
        self,
        pte: Path | bytes,
        shapes: StaticShapes,
        threads: int | None = None,
        weight_cache: bool = True,
    ):
        from executorch.runtime import Runtime

        from edgemtp.runtime import kernels

        kernel_problem = kernels.unavailable()
        self.weight_cache = weight_cache and enable_xnnpack_weight_cache()
        runtime = Runtime.get()
        if threads:
            from executorch.extension.pybindings import portable_lib

            portable_lib._unsafe_reset_threadpool(threads)
        self.program = runtime.load_program(pte)
        self.shapes = shapes
        # Load every method now: loading one initialises the shared cache buffers, which would
        # wipe the cache if it happened lazily in the middle of a sequence.
        try:
            self.methods: dict[str, Any] = {
                name: self.program.load_method(name) for name in sorted(self.program.method_names)
            }
        except RuntimeError as e:
            needed = _program_kernels(pte, "edgemtp::")
            if needed and kernel_problem:
                raise EdgeMTPError(
                    f"this program calls edgemtp's kernels ({', '.join(needed)}), which cannot "
                    f"be loaded here: {kernel_problem}"
                ) from e
            missing = [
                b for b in _delegate_backends(pte) if not runtime.backend_registry.is_available(b)
            ]
            if not missing:
                raise
            where = {"CoreMLBackend": "macOS 15+ / iOS 18+", "QnnBackend": "a Qualcomm device"}
            raise EdgeMTPError(
                f"this program is delegated to {', '.join(missing)}, which this ExecuTorch "
                f"runtime cannot run here: run it on {where.get(missing[0], 'its device')} "
                "(or export with --delegate cpu)"
            ) from e

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.methods[method].execute(inputs))


class _BackendOption(ctypes.Structure):
    """executorch::runtime::BackendOption: char key[64]; std::variant<bool, int,
    std::array<char, 256>> value (256 bytes of storage, then the one-byte index)."""

    _fields_ = [
        ("key", ctypes.c_char * 64),
        ("storage", ctypes.c_ubyte * 256),
        ("index", ctypes.c_ubyte),
        ("_pad", ctypes.c_ubyte * 3),
    ]


_SET_OPTION = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"


def enable_xnnpack_weight_cache() -> bool:
    """Set XNNPACK's `weight_cache_enabled` backend option (process-wide, before any method
    loads). ExecuTorch's Python bindings do not expose backend options, so this calls
    `executorch::runtime::set_option` in the wheel's libexecutorch.so; False when that is not
    possible (another build), and the runtime then works as before, with more memory."""
    try:
        from executorch.extension.pybindings import _C

        lib = Path(_C.__file__).parents[2] / "lib" / "libexecutorch.so"
        set_option = getattr(ctypes.CDLL(str(lib)), _SET_OPTION)
    except (ImportError, OSError, AttributeError):
        return False
    set_option.restype = ctypes.c_uint32
    set_option.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    option = _BackendOption(key=b"weight_cache_enabled", index=0)  # variant index 0: bool
    option.storage[0] = 1
    return set_option(b"XnnpackBackend", ctypes.addressof(option), 1) == 0


def _program(pte: Path | bytes) -> Any:
    from executorch.exir._serialize._program import deserialize_pte_binary

    return deserialize_pte_binary(pte if isinstance(pte, bytes) else Path(pte).read_bytes()).program


def _delegate_backends(pte: Path | bytes) -> list[str]:
    """Backend ids of a program's delegates."""
    return sorted({d.id for plan in _program(pte).execution_plan for d in plan.delegates})


def _program_kernels(pte: Path | bytes, namespace: str) -> list[str]:
    return program_kernels(_program(pte), namespace)


def program_kernels(program: Any, namespace: str = "") -> list[str]:
    """The operators (`ns::name.overload`) whose kernels an ExecuTorch `Program` calls."""
    return sorted(
        {
            f"{op.name}.{op.overload}" if op.overload else op.name
            for plan in program.execution_plan
            for op in plan.operators
            if op.name.startswith(namespace)
        }
    )

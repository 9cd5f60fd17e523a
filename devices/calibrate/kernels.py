"""edgemtp's own kernels: what the decode, verify and draft steps of an ExecuTorch bundle exported
with `--kernels edgemtp` run in place of XNNPACK's linears. Its Q4_0 linear is timed as those
steps call it, in an ExecuTorch program with the kernel library loaded, on one row and on a
verify's rows, streaming its weights from memory and from the cache (the profile's
`[delegates.cpu.backends.kernels]`)."""

from __future__ import annotations

import torch

from edgemtp.devices.calibrate.measure import (
    RESIDENT_LINEARS,
    STREAM_LINEARS,
    VERIFY_PROBE_ROWS,
    interleaved_medians,
    stream_rate,
)
from edgemtp.model.cost import BITS_PER_WEIGHT


class Q4_0Chain(torch.nn.Module):
    """Linears of n x n through `edgemtp::q4_0_linear`, one after another, each with its own
    weights (random codes and scales: the kernel's time does not depend on the values)."""

    def __init__(self, n: int, count: int, outputs: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(n)
        out = outputs or n  # (a chain of one linear may be narrow: n in, `outputs` out)
        for i in range(count):
            codes = torch.randint(0, 256, (out, n // 2), dtype=torch.uint8, generator=g)
            self.register_buffer(f"codes{i}", codes)
            self.register_buffer(
                f"scales{i}", (torch.rand(out, n // 32, generator=g) * 0.02).half()
            )
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.count):
            x = torch.ops.edgemtp.q4_0_linear(
                x, getattr(self, f"codes{i}"), getattr(self, f"scales{i}")
            )
        return x


def q4_0_weight_bytes(n_in: int, n_out: int) -> float:
    """Bytes the kernel reads for a linear: 4-bit codes and a float16 scale per 32 weights."""
    return n_in * n_out * BITS_PER_WEIGHT["q4_0"] / 8


def q4_0_program(n: int, count: int, rows: int, outputs: int | None = None):  # type: ignore[no-untyped-def]
    """A `Q4_0Chain` of `count` linears of n x n (x `outputs`) on `rows` rows, as an ExecuTorch
    program loaded in this process with edgemtp's kernel library."""
    from edgemtp.devices.calibrate.xnnpack import xnnpack_program
    from edgemtp.runtime import kernels
    from edgemtp.runtime.kernels import ops  # noqa: F401  (registers edgemtp::q4_0_linear)

    kernels.load()
    return xnnpack_program(Q4_0Chain(n, count, outputs), torch.randn(rows, n))


def q4_0_rates(
    n: int, count: int, fixed_us: float, calls: int, rows: tuple[int, ...] = (1, VERIFY_PROBE_ROWS)
) -> dict[int, float]:
    """Each of `rows` -> GB/s of Q4_0 bytes the kernel reads on that many rows through `count`
    linears of n x n, called `calls` times in a row (median of 9), less `fixed_us` per call
    (what the simulator prices apart). Small enough a chain stays in the cache from one call
    to the next (the resident rates); 8 x 8192 x 8192 (288 MiB) streams from memory."""
    from edgemtp.devices.calibrate.xnnpack import call_seconds

    rates = {}
    for r in rows:
        program, x = q4_0_program(n, count, r), torch.randn(r, n)
        seconds = call_seconds(program, x, calls, 9)
        rates[r] = stream_rate(count * q4_0_weight_bytes(n, n), seconds, fixed_us * 1e-6)
    return rates


# (inputs, outputs) of the narrow probe: an LM head's shape class (E2B x0.25's is 384 x
# 262144), 265 MB of Q4_0 blocks, past the caches as the streaming probe
NARROW_Q4_0 = (384, 2048 * 600)
NARROW_Q4_0_QUICK = (64, 2048 * 8)


def q4_0_gemv_ns(quick: bool = False) -> tuple[float, float]:
    """(GB/s of one row through the square streaming chain, ns per element (inputs + outputs)
    a one-row Q4_0 linear takes beyond its bytes at that rate): each output row's reduction
    and store, which a narrow linear (`NARROW_Q4_0`) pays per fewer bytes. The two probes are
    timed interleaved, 25 rounds, so that the host's drift falls on both alike: the element
    cost is a small difference of their times."""
    n = 1024 if quick else 8192
    k, outputs = NARROW_Q4_0_QUICK if quick else NARROW_Q4_0
    square, narrow = q4_0_program(n, STREAM_LINEARS, 1), q4_0_program(k, 1, 1, outputs=outputs)
    xs, xn = torch.randn(1, n), torch.randn(1, k)
    t_square, t_narrow = interleaved_medians(
        [lambda: square.forward((xs,)), lambda: narrow.forward((xn,))], 25
    )
    square_bytes = STREAM_LINEARS * q4_0_weight_bytes(n, n)
    beyond = t_narrow - q4_0_weight_bytes(k, outputs) * t_square / square_bytes
    return square_bytes / t_square / 1e9, max(beyond, 0.0) / (k + outputs) * 1e9


def kernel_rates(resident_side: int, fixed_us: float, quick: bool = False) -> dict[str, float]:
    """The profile's `[delegates.cpu.backends.kernels]` numbers: the Q4_0 kernel's streaming
    rates from memory (one row, a verify's rows), its time per element of a narrow linear
    beyond them and, where `resident_side`, its rates from the cache; none where edgemtp's
    kernel library does not load here."""
    from edgemtp.runtime import kernels

    if kernels.unavailable() is not None:
        return {}
    one_row, gemv_ns = q4_0_gemv_ns(quick)
    streamed = q4_0_rates(
        1024 if quick else 8192, STREAM_LINEARS, 0.0, 1, rows=(VERIFY_PROBE_ROWS,)
    )
    rates = {
        "memory_bandwidth_gbs": one_row,
        "verify_bandwidth_gbs": streamed[VERIFY_PROBE_ROWS],
        "ns_per_gemv_element": gemv_ns,
    }
    if resident_side:
        resident = q4_0_rates(resident_side, RESIDENT_LINEARS, fixed_us, 20)
        rates["resident_bandwidth_gbs"] = resident[1]
        rates["resident_verify_bandwidth_gbs"] = resident[VERIFY_PROBE_ROWS]
    return rates

"""How the probes time a call, the sizes they share, and the fits that turn their timings into
the simulator's terms: one place, so that XNNPACK and ONNX Runtime are measured alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from edgemtp.devices.simulator import VERIFY_PROBE_ROWS  # noqa: F401  (the probes' rows)

Call = Callable[[], object]  # what a probe times: one run of a kernel, or several in a row
# The least a fitted per-call or per-operator overhead is written as: a difference of two
# timings can come out at or under zero when the overhead is below the machine's noise, and a
# profile takes positive numbers only.
RESOLUTION_US = 0.01


def timings(run: Call, repeat: int) -> list[float]:
    """Seconds of each of `repeat` runs of `run`, after one untimed run."""
    run()  # warm-up: page faults, thread pools, lazy initialisation
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(run: Call, repeat: int) -> float:
    return statistics.median(timings(run, repeat))


def interleaved_medians(calls: Sequence[Call], rounds: int) -> list[float]:
    """Median seconds of each call, timed in turn round after round (so that the host's drift
    falls on all of them alike)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, times, strict=True):
            out += timings(call, 1)[:1]
    return [statistics.median(t) for t in times]


RESIDENT_LINEARS = 8  # small linears, as a small model's layers hold
STREAM_LINEARS = 8  # linears of 8192 x 8192 in the streaming probe: 288 MiB of weights


# (rows, side) of the two square int8 GEMMs the linear model is solved from: a wide one and a
# narrow one (E2B's hidden size is 1536, the embedded model's 256)
GEMM_SHAPES = ((256, 1024), (256, 256))
GEMM_QUICK = ((8, 128), (8, 32))
GEMM_CALLS = 3  # calls of a GEMM per timing


def gemm_rates(make: Callable[[int, int], Call], quick: bool) -> tuple[float, float]:
    """`fit_gemm` of a runtime's int8 linear, from `make(rows, side)` (`GEMM_CALLS` calls of a
    linear of side x side on `rows` rows) timed on `GEMM_SHAPES`, interleaved: a wide and a
    narrow shape, since a narrow linear's input quantization and output weigh more per FLOP."""
    shapes = GEMM_QUICK if quick else GEMM_SHAPES
    seconds = interleaved_medians([make(rows, side) for rows, side in shapes], 5 if quick else 15)
    return fit_gemm(shapes, [t / GEMM_CALLS for t in seconds])


def fit_gemm(shapes: Sequence[tuple[int, int]], seconds: Sequence[float]) -> tuple[float, float]:
    """(TOPS, ns per activation element) of a GEMM priced as `devices.simulator.call_terms`
    does, 2 x rows x k x n FLOPs at the peak plus rows x (k + n) elements read and written,
    solved from two square shapes' times. The narrow one's surplus beyond the wide one's
    FLOP rate is its elements' time; none where it has none (the peak is then the wide one's
    rate)."""
    flops = [2 * rows * side * side for rows, side in shapes]
    elements = [rows * 2 * side for rows, side in shapes]
    det = flops[0] * elements[1] - flops[1] * elements[0]
    per_flop = (seconds[0] * elements[1] - seconds[1] * elements[0]) / det
    per_element = (flops[0] * seconds[1] - flops[1] * seconds[0]) / det
    if per_element <= 0 or per_flop <= 0:
        return flops[0] / seconds[0] / 1e12, 0.0
    return 1 / per_flop / 1e12, per_element * 1e9


def stream_rate(weight_bytes: float, seconds: float, fixed_s: float) -> float:
    """GB/s of weight bytes read in `seconds`, less the kernels' fixed costs where they leave
    most of the time (the simulator adds those apart)."""
    streaming = seconds - fixed_s if seconds - fixed_s > 0.2 * seconds else seconds
    return weight_bytes / streaming / 1e9


def ns_per_element(
    make: Callable[[int], Call], many: int, few: int, per_row: int, rounds: int
) -> float:
    """ns per element written, from `make(rows)` (a call that writes `per_row` elements a row)
    on `many` rows less on `few`, timed interleaved: the fixed costs cancel."""
    t_many, t_few = interleaved_medians([make(many), make(few)], rounds)
    return max((t_many - t_few) / (per_row * (many - few)) * 1e9, 1e-3)


# (heads, rows, cache keys, head dim): two prefill chunks over a short cache, alike but for the
# head dim (score-bound: their difference is the matmuls' FLOP rate), and a decode step over a
# long cache (K/V-bound)
ATTENTION_SHAPES = ((8, 64, 1024, 32), (8, 64, 1024, 128), (8, 1, 4096, 256))
ATTENTION_QUICK = ((2, 16, 128, 16), (2, 16, 128, 64), (2, 1, 512, 64))


def attention_inputs(heads: int, rows: int, keys: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Queries scaled so that the scores are N(0, 1), as a trained model's are about: unscaled,
    a head dim of 512 gives scores of std 23 and a softmax full of denormal floats."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads * rows, dim, generator=g) * dim**-0.5
    cache = [torch.randn(1, n, dim, generator=g) for n in (keys, rows, keys, rows)]
    return (q, cache[0], cache[1], cache[2], cache[3], torch.zeros(rows, keys + rows))


def attention_rates(
    make: Callable[[tuple[torch.Tensor, ...]], Call], quick: bool = False
) -> tuple[float, float, float]:
    """(TFLOPS of the matmuls, ns per score, GB/s the K/V stream at) of a runtime's attention,
    from `make(inputs)` (a call of `SegmentAttention` on those inputs) timed on the three
    `ATTENTION_SHAPES`, interleaved (median of each)."""
    shapes = ATTENTION_QUICK if quick else ATTENTION_SHAPES
    calls = [make(attention_inputs(*shape)) for shape in shapes]
    return fit_attention(shapes, interleaved_medians(calls, 5 if quick else 25))


def fit_attention(
    shapes: Sequence[tuple[int, int, int, int]], seconds: Sequence[float]
) -> tuple[float, float, float]:
    """The attention model `devices.simulator.call_terms` prices, solved for its three rates:
    the two score-bound shapes differ only in FLOPs, which gives the matmuls' rate; the rest of
    the first is its scores' time; what the K/V-bound third takes beyond its scores streams
    its K/V (fixed call costs are ignored: the shapes are large enough to dwarf them)."""
    scores = [h * r * (k + r) for h, r, k, _ in shapes]
    flops = [4 * n * d for n, (*_, d) in zip(scores, shapes, strict=True)]
    tops = (flops[1] - flops[0]) / max(seconds[1] - seconds[0], 1e-9) / 1e12
    ns_per_score = max(seconds[0] - flops[0] / (tops * 1e12), 1e-12 * scores[0]) / scores[0] * 1e9
    _, rows, keys, dim = shapes[2]
    streaming = max(seconds[2] - scores[2] * ns_per_score * 1e-9, flops[2] / (tops * 1e12))
    return tops, ns_per_score, 2 * (keys + rows) * dim * 4 / streaming / 1e9

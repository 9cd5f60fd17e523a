"""What runtimes achieve on the shipped device profiles, fitted to published figures, and how
far the fit carries: each figure predicted by a fit that did not see it (leave-one-out).

A profile holds hardware specifications. What a runtime gets out of them is a handful of
factors on them, shared by every device of a unit class (cpu; gpu and metal; htp) or by every
class, so that a figure on one device informs the others and a device with no published figure
still gets rates:

    achieved bandwidth   = bandwidth x the profile's sustained bandwidth          (every class)
    launch cost          = dispatch x the profile's dispatch_us    (per kernel: cpu, gpu; per
                                                                    graph call: htp's own)
    achieved GEMM rate   = gemm[class] x the profile's peak (prompt chunks; every dtype)
    achieved GEMV rate   = gemv[class] x the profile's peak (a linear's first row; cpu)
    time                 = engine[engine] x the simulator's time at those rates

A factor a class's figures cannot pin down is not fitted (`FREE`): it stays 1, the profile's
number. LiteRT-LM's engine factor is 1: most figures are its, so the others are relative to it.
The fit is least squares on log(predicted / published), with a weak prior at 1 (`PRIOR_WIDTH`,
log units) on each factor but `UNPRIORED`: a factor that no remaining figure informs in a
leave-one-out fit stays near the profile's number instead of running off.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np

from edgemtp.devices.profiles import DelegateProfile, DeviceProfile, list_profiles, load_profile
from edgemtp.devices.simulator import (
    Plan,
    Rates,
    compute_dtype,
    model_from_preset,
    plan_calls,
    price,
)
from edgemtp.errors import EdgeMTPError

PUBLISHED = Path(__file__).parent / "published.json"
FITTED = Path(__file__).parent / "fitted.json"  # the fit of every figure, for `simulate`
REFERENCE_ENGINE = "litert-lm"
UNIT_CLASS = {"cpu": "cpu", "gpu": "gpu", "metal": "gpu", "htp": "htp"}  # npu: no figure yet
# The factors each class's own figures can tell apart: cpu has prompts on four devices (GEMM)
# and a decode that is compute-bound (the 2-core iPhone: GEMV); gpu has one prompt; htp has
# prompts only, pruned or not at two lengths (GEMM, and the fixed cost of each graph call).
FREE = {
    "cpu": ("gemm", "gemv"),
    "gpu": ("gemm",),
    "htp": ("gemm", "dispatch"),
}
# One factor for every class (a class's own overrides it): DRAM is the same for all of a SoC's
# units, and a launch on a kernel-dispatch unit (cpu, gpu) costs what the engine's kernels make
# of it; the htp's is a whole graph call, so it has its own.
SHARED = ("bandwidth", "dispatch")
# where the search starts: a GEMV far below the peak (where its term matters), launches cheap
START = {"gemv": 0.05, "dispatch": 0.1}
# No prior on launch costs and the GEMV rate: the profile has no number they scale sensibly
# (a launch's cost depends on the engine's kernels, fused or not, and the figures want it near
# zero where launches overlap the work; a one-row linear cannot use the peak's matrix
# instructions). Bounded instead.
UNPRIORED = ("dispatch", "gemv")
BOUNDS = (math.log(1e-4), math.log(100.0))
PRIOR_WIDTH = 2.0  # log units: a factor e^2 ~ 7 away from the profile costs one residual


@dataclass(frozen=True)
class Figure:
    """One published speed and the conditions it was measured under (`devices/published.json`)."""

    id: str
    model: str
    engine: str
    device: str
    delegate: str
    quantity: str  # "prefill" or "decode"
    tok_s: float
    quant: str
    prompt: int
    gen: int
    chunk: int
    threads: int | None
    pruned: bool
    source: str
    assumed: tuple[str, ...]

    @property
    def unit_class(self) -> str:
        return UNIT_CLASS[self.delegate]


def load_figures(path: Path = PUBLISHED) -> list[Figure]:
    raw = json.loads(Path(path).read_text())
    fields = Figure.__dataclass_fields__
    return [
        Figure(**{k: tuple(v) if k == "assumed" else v for k, v in f.items() if k in fields})
        for f in raw["figures"]
    ]


def load_mtp(path: Path = PUBLISHED) -> list[dict]:
    return json.loads(Path(path).read_text())["mtp"]


def usable(figures: Sequence[Figure]) -> tuple[list[Figure], list[tuple[Figure, str]]]:
    """The figures the fit can use, and the others with the reason: no shipped profile for the
    device or its unit, or a speed the profiled machine cannot reach (`beyond_the_machine`)."""
    known = set(list_profiles())
    fitted, left_out = [], []
    for f in figures:
        if f.device not in known:
            reason = f"no {f.device!r} profile"
        elif f.delegate not in profile(f.device).delegates:
            reason = f"the {f.device!r} profile has no {f.delegate} delegate"
        else:
            reason = beyond_the_machine(f)
        if reason:
            left_out.append((f, reason))
        else:
            fitted.append(f)
    return fitted, left_out


def beyond_the_machine(figure: Figure) -> str | None:
    """Why the figure cannot be the run the model prices on its profiled machine, or None: a
    decode that would stream a step's bytes faster than the bus's theoretical peak, or a
    prefill that would compute faster than the unit's peak at any dtype. Such a figure was
    measured on other hardware or another run (a larger chip, a pruned model, drafting on)
    than its conditions say; fitting it would push every factor past what the hardware has."""
    unit = profile(figure.device).delegates[figure.delegate]
    if figure.quantity == "decode":
        gbs = plan_of(figure).verify[0].work.bytes * figure.tok_s / 1e9
        if gbs > unit.peak_memory_bandwidth_gbs:
            return (
                f"needs {gbs:.0f} GB/s to stream a step's weights and cache at "
                f"{figure.tok_s:g} tok/s; the bus peaks at {unit.peak_memory_bandwidth_gbs:g}"
            )
        return None
    tops = prompt_flops(figure) / figure.prompt * figure.tok_s / 1e12
    peak = max(unit.peak_tops.values())
    if tops > peak:
        return f"needs {tops:.1f} TOPS at {figure.tok_s:g} tok/s; the unit peaks at {peak:g}"
    return None


def prompt_flops(figure: Figure) -> float:
    """The FLOPs of the figure's whole prompt, pruned or not as it ran."""
    return sum(c.work.flops for c in plan_of(figure).prefill)


@cache
def _plan(model: str, quant: str, prompt: int, gen: int, chunk: int, pruned: bool) -> Plan:
    """The calls a figure's run makes: the preset as another engine runs it (a cache that holds
    only the keys so far; the prefill pruned or not), AR decode in the middle of its span."""
    built = model_from_preset(model, quant, prompt + gen + 2, chunk, 0, ())
    built = replace(built, pruned_prefill=pruned, dynamic_cache=True)
    return plan_calls(built, (0,), prompt, max(gen, 1))


def plan_of(figure: Figure) -> Plan:
    return _plan(figure.model, figure.quant, figure.prompt, figure.gen, figure.chunk, figure.pruned)


def parameters(figures: Sequence[Figure]) -> list[str]:
    """The free factors these figures fit: their classes' `FREE` ones, and one per engine
    other than the reference."""
    classes = sorted({f.unit_class for f in figures})
    names = [f"all.{name}" for name in SHARED]
    names += [f"{c}.{name}" for c in classes for name in FREE[c]]
    return names + sorted({f"engine.{f.engine}" for f in figures} - {f"engine.{REFERENCE_ENGINE}"})


def achieved(
    unit: DelegateProfile, dtype: str, factors: dict[str, float], threads: int | None = None
) -> DelegateProfile:
    """`unit` as a runtime achieves it, given its class's factors (absent: 1). `threads`: a
    figure's, where it ran on fewer or more cores than the profile counts."""
    cls = UNIT_CLASS[unit.name]
    f = {
        name: factors.get(f"{cls}.{name}", factors.get(f"all.{name}", 1.0))
        for name in ("bandwidth", "gemm", "gemv", "dispatch")
    }
    cores = threads / unit.threads if threads and unit.threads else 1.0
    few = None
    if f"{cls}.gemv" in factors:
        few = f["gemv"] * unit.peak_tops[dtype] * cores
    return replace(
        unit,
        memory_bandwidth_gbs=f["bandwidth"] * unit.memory_bandwidth_gbs,
        peak_tops={k: f["gemm"] * v * cores for k, v in unit.peak_tops.items()},
        few_rows_tops=few,
        dispatch_us=f["dispatch"] * unit.dispatch_us,
    )


def rates(
    device: DeviceProfile, delegate: str, engine: str, factors: dict[str, float], source: str
) -> Rates | None:
    """What `engine` achieves on a delegate of `device`; None where the fit has nothing for its
    class (then the profile's own numbers stand)."""
    cls = UNIT_CLASS.get(delegate)
    if cls is None or not any(k.startswith(f"{cls}.") for k in factors):
        return None
    if engine != REFERENCE_ENGINE and f"engine.{engine}" not in factors:
        known = sorted({REFERENCE_ENGINE} | {k[7:] for k in factors if k.startswith("engine.")})
        raise EdgeMTPError(f"no fitted factor for engine {engine!r}; fitted: {', '.join(known)}")
    unit = device.delegates[delegate]
    dtype = compute_dtype(unit, delegate, "q4_0")
    return Rates(
        achieved(unit, dtype, factors),
        engine,
        factors.get(f"engine.{engine}", 1.0),
        source,
    )


profile = cache(load_profile)  # a fit prices every figure hundreds of times


def predict(figure: Figure, factors: dict[str, float]) -> float:
    """The figure's tok/s at these factors."""
    unit = profile(figure.device).delegates[figure.delegate]
    dtype = compute_dtype(unit, figure.delegate, figure.quant)
    fitted = achieved(unit, dtype, factors, figure.threads)
    engine = factors.get(f"engine.{figure.engine}", 1.0)
    plan = plan_of(figure)
    if figure.quantity == "prefill":
        seconds = sum(price(c, fitted, dtype, plan.vocab, engine).seconds for c in plan.prefill)
        return figure.prompt / seconds
    return 1 / price(plan.verify[0], fitted, dtype, plan.vocab, engine).seconds


@dataclass(frozen=True)
class Fit:
    factors: dict[str, float]
    figures: int
    parameters: int
    rms_log_error: float


def fit(figures: Sequence[Figure], prior_width: float | None = PRIOR_WIDTH) -> Fit:
    """Least squares on log(predicted / published) over `figures`, a weak prior at 1 of
    `prior_width` (None: none) on each free factor but `UNPRIORED`."""
    from scipy.optimize import least_squares  # (the fit only: `simulate` reads fitted.json)

    names = parameters(figures)
    if len(names) >= len(figures):
        raise EdgeMTPError(f"{len(names)} factors for {len(figures)} figures: fit fewer")

    def residuals(x: np.ndarray) -> np.ndarray:
        factors = dict(zip(names, np.exp(x), strict=True))
        errors = [math.log(predict(f, factors) / f.tok_s) for f in figures]
        return np.concatenate([errors, x[priored] / (prior_width or 1.0)])

    priored = np.array([n.split(".")[-1] not in UNPRIORED for n in names])
    if prior_width is None:
        priored[:] = False
    start = np.log([START.get(n.split(".")[-1], 1.0) for n in names])
    solved = least_squares(residuals, start, diff_step=1e-4, bounds=BOUNDS)
    errors = solved.fun[: len(figures)]
    return Fit(
        {n: float(v) for n, v in zip(names, np.exp(solved.x), strict=True)},
        len(figures),
        len(names),
        float(np.sqrt(np.mean(errors**2))),
    )


@dataclass(frozen=True)
class Held:
    """A figure predicted by the fit of every other one."""

    figure: Figure
    predicted: float
    fit: Fit
    # the only figure of its class and quantity, or of its engine: in this fit its factor
    # stays at the prior (the profile's number, engine factor 1)
    alone: bool

    @property
    def error(self) -> float:
        return self.predicted / self.figure.tok_s - 1


def leave_one_out(figures: Sequence[Figure]) -> list[Held]:
    held = []
    for i, figure in enumerate(figures):
        rest = [f for j, f in enumerate(figures) if j != i]
        result = fit(rest)
        alone = not any(
            f.unit_class == figure.unit_class and f.quantity == figure.quantity for f in rest
        ) or not any(f.engine == figure.engine for f in rest)
        held.append(Held(figure, predict(figure, result.factors), result, alone))
    return held


def write_fitted(result: Fit, path: Path = FITTED) -> None:
    doc = {
        "about": "Factors fitted by devices/fit.py to every usable figure of "
        "devices/published.json (rerun: python benchmarks/simulator_published.py). "
        f"Engine factors are relative to {REFERENCE_ENGINE}.",
        "figures": result.figures,
        "parameters": result.parameters,
        "rms_log_error": round(result.rms_log_error, 4),
        "factors": {k: float(f"{v:.6g}") for k, v in result.factors.items()},
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_fitted(path: Path = FITTED) -> dict[str, float]:
    return dict(json.loads(Path(path).read_text())["factors"])


def fitted_rates(
    device: DeviceProfile, delegate: str, engine: str = REFERENCE_ENGINE
) -> Rates | None:
    """The stored fit's rates for `engine` on a delegate of `device` (None: not fitted)."""
    source = (
        f"the profile's {delegate} numbers times factors fitted to published figures "
        f"({FITTED.name}), as {engine} runs"
    )
    return rates(device, delegate, engine, load_fitted(), source)

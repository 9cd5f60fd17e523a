"""Choosing the energy source to read here (`detect`), and what a run's tokens cost from two
samples of it: `energy_report` works it out, `EnergyMeter` samples before and after a run.
A missing or failing source gives every number null and `reason` "unavailable: <why>".
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemtp.runtime.probes.adb import AdbReader
from edgemtp.runtime.probes.ioreg import IoregReader
from edgemtp.runtime.probes.power_supply import PowerSupplyReader
from edgemtp.runtime.probes.rapl import RaplReader
from edgemtp.runtime.probes.sample import EnergyReader, EnergySample, ProbeUnavailable, Runner

REPORT_KEYS = (
    "source",
    "energy_j",
    "j_per_token",
    "avg_power_w",
    "battery_pct_per_1k_tokens",
    "reason",
)


def _unavailable_report(reason: str) -> dict[str, Any]:
    report: dict[str, Any] = dict.fromkeys(REPORT_KEYS)
    report["reason"] = f"unavailable: {reason}"
    return report


@dataclass(frozen=True)
class Unavailable:
    """What `detect` returns when no source can be read; shaped like a reader that never is."""

    reason: str
    name: str | None = None

    def available(self) -> str:
        return self.reason

    def sample(self) -> EnergySample:
        raise ProbeUnavailable(self.reason)

    def report(self) -> dict[str, Any]:
        """The `energy_report` dict with every number null and `reason` "unavailable: <why>"."""
        return _unavailable_report(self.reason)


def detect(
    *,
    android: bool = False,
    adb_serial: str | None = None,
    adb_run: Runner | None = None,
    ioreg_run: Runner | None = None,
    platform: str = sys.platform,
    power_supply_root: Path = Path("/sys/class/power_supply"),
    powercap_root: Path = Path("/sys/class/powercap"),
) -> EnergyReader | Unavailable:
    """The best energy source here, or an `Unavailable` that says why each one is not.

    `android=True`: the model runs on an attached Android device, so only its battery counts (the
    host's sensors would measure the wrong machine). Else on Linux RAPL (µJ resolution, updated
    every millisecond), then the battery (its gauge updates every few seconds); on macOS ioreg.
    """
    readers: list[EnergyReader]
    if android:
        readers = [AdbReader(adb_run, adb_serial)]
    elif platform.startswith("linux"):
        readers = [RaplReader(powercap_root), PowerSupplyReader(power_supply_root)]
    elif platform == "darwin":
        readers = [IoregReader(ioreg_run)]
    else:
        return Unavailable(f"no energy reader for platform {platform!r}")
    reasons = []
    for reader in readers:
        why = reader.available()
        if why is None:
            return reader
        reasons.append(f"{reader.name}: {why}")
    return Unavailable("; ".join(reasons))


def integrate_power(samples: Sequence[EnergySample]) -> float | None:
    """Energy in J from power samples by the trapezoid rule; None with fewer than two powers."""
    points = sorted((s.t, s.power_w) for s in samples if s.power_w is not None)
    if len(points) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in itertools.pairwise(points))


def energy_report(
    start: EnergySample,
    end: EnergySample,
    tokens: int,
    battery_wh: float | None = None,
    power_samples: Sequence[EnergySample] = (),
) -> dict[str, Any]:
    """What `tokens` tokens cost between two samples of one reader, as a JSON-ready dict.

    Energy is the counter's rise (RAPL), the battery's drop, or, where the source gives only
    power, the trapezoid integral of start, `power_samples` and end. Each number that cannot be
    computed is null and `reason` says why. `battery_pct_per_1k_tokens` needs the battery's
    capacity: `battery_wh`, else the source's own (energy_full and the like).
    """
    if start.source != end.source:
        return _unavailable_report(
            f"start and end come from different sources ({start.source}, {end.source})"
        )
    reasons: list[str] = []
    seconds = end.t - start.t
    energy: float | None = None
    e0, e1 = start.energy_j, end.energy_j
    if seconds <= 0:
        reasons.append("the end sample is not after the start")
    elif start.cumulative:
        if e0 is None or e1 is None:
            reasons.append("the energy counter was not read")
        elif e1 > e0:
            energy = e1 - e0
        else:
            reasons.append("the energy counter did not move: run longer")
    elif start.charging or end.charging:
        reasons.append(
            "the battery was charging or on external power, so its drop does not measure use: "
            "run on battery (Android: wireless adb)"
        )
    elif e0 is not None and e1 is not None:
        if e0 > e1:
            energy = e0 - e1
        else:
            reasons.append(
                "the battery's energy did not drop: its gauge updates every few seconds to a "
                "minute, so run longer"
            )
    else:
        energy = integrate_power([start, *power_samples, end])
        if energy is None:
            reasons.append("the source gave neither energy nor power readings")

    j_per_token = avg_power = pct_per_1k = None
    if energy is not None:
        avg_power = energy / seconds
        if tokens > 0:
            j_per_token = energy / tokens
        else:
            reasons.append("no tokens were generated")
        capacity = battery_wh * 3600 if battery_wh else (end.capacity_j or start.capacity_j)
        if not capacity:
            reasons.append("battery capacity unknown: pass battery_wh")
        elif j_per_token is not None:
            pct_per_1k = j_per_token * 1000 / capacity * 100
    return {
        "source": start.source,
        "energy_j": energy,
        "j_per_token": j_per_token,
        "avg_power_w": avg_power,
        "battery_pct_per_1k_tokens": pct_per_1k,
        "reason": "; ".join(reasons) or None,
    }


class EnergyMeter:
    """Samples an energy source before and after a run: `begin()`, run, `report(tokens)`.

    The report is `energy_report`'s dict, or, when the source is missing or fails to read,
    every number null and `reason` "unavailable: <why>".
    """

    def __init__(
        self, reader: EnergyReader | Unavailable | None = None, battery_wh: float | None = None
    ):
        self.reader = reader if reader is not None else detect()
        self.battery_wh = battery_wh
        self.start: EnergySample | None = None
        self.reason: str | None = None

    def begin(self) -> None:
        try:
            self.start = self.reader.sample()
        except ProbeUnavailable as err:
            self.start, self.reason = None, err.reason

    def report(self, tokens: int) -> dict[str, Any]:
        if self.start is None:
            return _unavailable_report(self.reason or "begin() was not called")
        try:
            end = self.reader.sample()
        except ProbeUnavailable as err:
            return _unavailable_report(err.reason)
        return energy_report(self.start, end, tokens, self.battery_wh)

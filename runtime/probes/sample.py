"""What every energy reader shares: the `EnergySample` it returns, the `EnergyReader` protocol,
`ProbeUnavailable` (a source that cannot be read says why, never makes a number up), the units
the sources use, and running the commands (adb, ioreg) some readers parse.

Charge-based batteries: energy = charge × voltage, where the voltage is the first one the reader
saw (or the design voltage when the battery gives no present voltage). Using each sample's own
voltage would read the voltage sag of a loaded battery as spent energy (a 2 % sag on a 40 kJ
battery is 800 J). So take the start and end samples of a run from the same reader.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edgemtp.errors import EdgeMTPError

Runner = Callable[[list[str]], str]
"""Runs a program with these arguments (the program's name left out) and returns its output."""

UWH_TO_J = 3600e-6  # 1 µWh = 3.6 mJ
UAH_TO_C = 3600e-6  # 1 µAh = 3.6 mC


class ProbeUnavailable(EdgeMTPError):
    """The energy source cannot be read here; `reason` says why and, where there is one, the fix."""

    def __init__(self, reason: str):
        super().__init__(f"unavailable: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class EnergySample:
    """One reading of an energy source.

    `energy_j` is either a cumulative counter of energy used (`cumulative=True`, RAPL) or the
    energy left in a battery (`cumulative=False`). `power_w` is the instantaneous power magnitude
    (discharge rate, or charge rate while charging). `charging` is True while external power
    charges or holds the battery (Charging, Full, Not charging, plugged in): a battery's drop then
    measures nothing. `capacity_j` is the full battery's energy where the source knows it.
    """

    t: float  # time.monotonic() seconds
    energy_j: float | None = None
    power_w: float | None = None
    battery_pct: float | None = None
    charging: bool | None = None
    source: str | None = None
    capacity_j: float | None = None
    cumulative: bool = False


class EnergyReader(Protocol):
    """`available()`: None when usable, else why not; `sample()` raises `ProbeUnavailable`."""

    name: str

    def available(self) -> str | None: ...

    def sample(self) -> EnergySample: ...


def unavailable_reason(read: Callable[[], object]) -> str | None:
    """None when `read()` succeeds, else the reason it raised `ProbeUnavailable`."""
    try:
        read()
    except ProbeUnavailable as err:
        return err.reason
    return None


def int_or_none(text: str | None) -> int | None:
    """A sysfs or command value as an integer; None when absent or not one."""
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def reading_time(t0: float) -> float:
    """The midpoint of a reading that began at t0, so slow reads (adb) are dated fairly."""
    return (t0 + time.monotonic()) / 2


def run_command(program: str, args: list[str], timeout: float = 10.0) -> str:
    """Runs `program args...` and returns stdout then stderr: error text is what the readers parse.

    Raises FileNotFoundError when the program is not installed, subprocess.TimeoutExpired.
    """
    proc = subprocess.run([program, *args], capture_output=True, text=True, timeout=timeout)
    return proc.stdout + proc.stderr

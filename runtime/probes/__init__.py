"""Energy and memory probes: what each generated token cost, read from the device's real sources.

A source this host lacks reports "unavailable: <why>", never a made-up number. One reader per
energy source, each with `name`, `available()` (None when usable, else why not) and `sample()`:

- `power_supply`: Linux `/sys/class/power_supply/*` batteries
- `rapl`: Linux powercap RAPL energy counters
- `adb`: an Android device's battery over adb
- `ioreg`: a Mac's battery

`sample` holds what they share; `meter` picks the source here and reports what a run's tokens
cost; `memory` reads this process's resident set and the machine's RAM.
"""

from edgemtp.runtime.probes.adb import AdbReader, parse_dumpsys_battery
from edgemtp.runtime.probes.ioreg import IoregReader, parse_ioreg
from edgemtp.runtime.probes.memory import current_rss_mb, peak_rss_mb, physical_memory
from edgemtp.runtime.probes.meter import (
    EnergyMeter,
    Unavailable,
    detect,
    energy_report,
    integrate_power,
)
from edgemtp.runtime.probes.power_supply import PowerSupplyReader
from edgemtp.runtime.probes.rapl import RaplReader, rapl_delta_uj
from edgemtp.runtime.probes.sample import EnergyReader, EnergySample, ProbeUnavailable

__all__ = [
    "AdbReader",
    "EnergyMeter",
    "EnergyReader",
    "EnergySample",
    "IoregReader",
    "PowerSupplyReader",
    "ProbeUnavailable",
    "RaplReader",
    "Unavailable",
    "current_rss_mb",
    "detect",
    "energy_report",
    "integrate_power",
    "parse_dumpsys_battery",
    "parse_ioreg",
    "peak_rss_mb",
    "physical_memory",
    "rapl_delta_uj",
]

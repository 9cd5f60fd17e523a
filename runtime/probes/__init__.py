"""Energy and memory probes: what each generated token cost, read from the device's real sources.

A source this host lacks reports "unavailable: <why>", never a made-up number.
"""

from edgemtp.runtime.probes.energy import (
    AdbReader,
    EnergyMeter,
    EnergyReader,
    EnergySample,
    IoregReader,
    PowerSupplyReader,
    ProbeUnavailable,
    RaplReader,
    Unavailable,
    detect,
    energy_report,
    integrate_power,
    parse_dumpsys_battery,
    parse_ioreg,
    rapl_delta_uj,
)
from edgemtp.runtime.probes.memory import current_rss_mb, peak_rss_mb, physical_memory

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

"""Linux batteries under `/sys/class/power_supply/*` (laptops, Android sysfs, Raspberry Pi UPS
hats): the energy left, from `energy_now` (µWh) or from `charge_now`/`charge_counter` (µAh) times
a voltage, and the power drawn, from `power_now` or `current_now` times `voltage_now`.
"""

from __future__ import annotations

import time
from pathlib import Path

from edgemtp.runtime.probes.sample import (
    UAH_TO_C,
    UWH_TO_J,
    EnergySample,
    ProbeUnavailable,
    int_or_none,
    reading_time,
)

_PS_ATTRS = (
    "type",
    "scope",
    "present",
    "status",
    "capacity",
    "energy_now",
    "energy_full",
    "power_now",
    "charge_now",
    "charge_counter",
    "charge_full",
    "current_now",
    "voltage_now",
    "voltage_min_design",
    "voltage_max_design",
)


def read_power_supply(path: Path) -> dict[str, str]:
    """One power_supply device's attributes: `uevent`'s POWER_SUPPLY_* lines, then the files.

    Keys are the attribute file names (`energy_now`, ...); a file that exists wins over uevent.
    """
    values: dict[str, str] = {}
    try:
        uevent = (path / "uevent").read_text()
    except OSError:
        uevent = ""
    for line in uevent.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("POWER_SUPPLY_"):
            values[key.removeprefix("POWER_SUPPLY_").lower()] = value.strip()
    for attr in _PS_ATTRS:
        try:
            values[attr] = (path / attr).read_text().strip()
        except OSError:  # absent, or a driver that answers EIO/ENODATA for it
            pass
    return values


def _charging_from_status(status: str | None) -> bool | None:
    if status == "Discharging":
        return False
    if status in ("Charging", "Full", "Not charging"):
        return True
    return None  # "Unknown" or none


class PowerSupplyReader:
    """System batteries under `/sys/class/power_supply` (type Battery, not a peripheral's).

    Several batteries (a ThinkPad's BAT0 and BAT1) are summed. A wireless mouse's battery
    (`scope` Device) and absent batteries are left out.
    """

    name = "power_supply"

    def __init__(self, root: Path = Path("/sys/class/power_supply")):
        self.root = Path(root)
        self._volts_ref: dict[Path, float] = {}  # the first voltage seen: see probes/sample.py

    def batteries(self) -> list[tuple[Path, dict[str, str]]]:
        found = []
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            values = read_power_supply(path)
            if values.get("type") != "Battery" or values.get("scope") == "Device":
                continue
            if values.get("present") == "0":
                continue
            found.append((path, values))
        return found

    def available(self) -> str | None:
        if not self.root.is_dir():
            return f"no {self.root} (not Linux, or sysfs is not mounted)"
        batteries = self.batteries()
        if not batteries:
            return f"no system battery under {self.root} (a desktop, a VM, or on mains only)"
        for path, values in batteries:
            if not any(values.get(k) for k in ("energy_now", "charge_now", "charge_counter")):
                if not values.get("power_now") and not values.get("current_now"):
                    return f"{path} gives neither energy, charge, power nor current"
        return None

    def _battery(self, path: Path, values: dict[str, str], t: float) -> EnergySample:
        volts_now = int_or_none(values.get("voltage_now"))
        volts = volts_now / 1e6 if volts_now else None
        if path not in self._volts_ref:
            design = int_or_none(values.get("voltage_min_design")) or int_or_none(
                values.get("voltage_max_design")
            )
            ref = volts or (design / 1e6 if design else None)
            if ref:
                self._volts_ref[path] = ref
        volts_ref = self._volts_ref.get(path)

        energy = full = None
        energy_uwh = int_or_none(values.get("energy_now"))
        charge_uah = int_or_none(values.get("charge_now"))
        if charge_uah is None:
            charge_uah = int_or_none(values.get("charge_counter"))  # Android's coulomb counter
        if energy_uwh is not None:
            energy = energy_uwh * UWH_TO_J
            full_uwh = int_or_none(values.get("energy_full"))
            full = full_uwh * UWH_TO_J if full_uwh else None
        elif charge_uah is not None and volts_ref:
            energy = charge_uah * UAH_TO_C * volts_ref
            full_uah = int_or_none(values.get("charge_full"))
            full = full_uah * UAH_TO_C * volts_ref if full_uah else None

        power = None
        power_uw = int_or_none(values.get("power_now"))
        current_ua = int_or_none(values.get("current_now"))
        if power_uw is not None:
            power = abs(power_uw) / 1e6
        elif current_ua is not None and volts:
            power = abs(current_ua) / 1e6 * volts  # drivers disagree on the sign

        capacity = int_or_none(values.get("capacity"))
        return EnergySample(
            t=t,
            energy_j=energy,
            power_w=power,
            battery_pct=float(capacity) if capacity is not None else None,
            charging=_charging_from_status(values.get("status")),
            source=self.name,
            capacity_j=full,
        )

    def sample(self) -> EnergySample:
        t0 = time.monotonic()
        batteries = self.batteries()
        t = reading_time(t0)
        if not batteries:
            raise ProbeUnavailable(self.available() or f"no system battery under {self.root}")
        parts = [self._battery(path, values, t) for path, values in batteries]
        if len(parts) == 1:
            return parts[0]

        def total(values: list[float | None]) -> float | None:
            return None if None in values else sum(v for v in values if v is not None)

        energy = total([p.energy_j for p in parts])
        full = total([p.capacity_j for p in parts])
        states = [p.charging for p in parts]
        return EnergySample(
            t=t,
            energy_j=energy,
            power_w=total([p.power_w for p in parts]),
            battery_pct=100 * energy / full if energy is not None and full else None,
            charging=True if True in states else (False if set(states) == {False} else None),
            source=self.name,
            capacity_j=full,
        )

"""Readers of the energy sources a phone or laptop really has, and the per-token energy report.

Four sources, one reader each:

- `PowerSupplyReader`: Linux `/sys/class/power_supply/*` batteries (laptops, Android sysfs,
  Raspberry Pi UPS hats). Energy left in the battery, from `energy_now` (µWh) or from
  `charge_now`/`charge_counter` (µAh) times a voltage.
- `RaplReader`: Linux powercap RAPL, `/sys/class/powercap/intel-rapl:N[:M]/energy_uj`, a
  cumulative counter (µJ) that wraps at `max_energy_range_uj`; the reader unwraps it.
- `AdbReader`: an Android device over adb: `dumpsys battery` plus
  `/sys/class/power_supply/battery/{current_now,voltage_now,charge_counter}`.
- `IoregReader`: macOS `ioreg -rn AppleSmartBattery`.

Every reader has `name`, `available()` (None when usable, else why not) and `sample()`, which
returns an `EnergySample` or raises `ProbeUnavailable`; no reader ever makes a number up.

Charge-based batteries: energy = charge × voltage, where the voltage is the first one the reader
saw (or the design voltage when the battery gives no present voltage). Using each sample's own
voltage would read the voltage sag of a loaded battery as spent energy: a 2 % sag on a 40 kJ
battery is 800 J, more than a minute of decoding costs. So take the start and end samples of a
run from the same reader.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edgemtp.errors import EdgeMTPError

Runner = Callable[[list[str]], str]
"""Runs a program with these arguments (the program's name left out) and returns its output."""

UWH_TO_J = 3600e-6  # 1 µWh = 3.6 mJ
UAH_TO_C = 3600e-6  # 1 µAh = 3.6 mC

REPORT_KEYS = (
    "source",
    "energy_j",
    "j_per_token",
    "avg_power_w",
    "battery_pct_per_1k_tokens",
    "reason",
)


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
    name: str

    def available(self) -> str | None: ...

    def sample(self) -> EnergySample: ...


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


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _now_between(t0: float) -> float:
    """The midpoint of a reading that began at t0, so slow reads (adb) are dated fairly."""
    return (t0 + time.monotonic()) / 2


# --- Linux power_supply ---------------------------------------------------------------------

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
        self._volts_ref: dict[Path, float] = {}  # see the module docstring

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
        volts_now = _int(values.get("voltage_now"))
        volts = volts_now / 1e6 if volts_now else None
        if path not in self._volts_ref:
            design = _int(values.get("voltage_min_design")) or _int(
                values.get("voltage_max_design")
            )
            ref = volts or (design / 1e6 if design else None)
            if ref:
                self._volts_ref[path] = ref
        volts_ref = self._volts_ref.get(path)

        energy = full = None
        energy_uwh = _int(values.get("energy_now"))
        charge_uah = _int(values.get("charge_now"))
        if charge_uah is None:
            charge_uah = _int(values.get("charge_counter"))  # Android's coulomb counter
        if energy_uwh is not None:
            energy = energy_uwh * UWH_TO_J
            full_uwh = _int(values.get("energy_full"))
            full = full_uwh * UWH_TO_J if full_uwh else None
        elif charge_uah is not None and volts_ref:
            energy = charge_uah * UAH_TO_C * volts_ref
            full_uah = _int(values.get("charge_full"))
            full = full_uah * UAH_TO_C * volts_ref if full_uah else None

        power = None
        power_uw = _int(values.get("power_now"))
        current_ua = _int(values.get("current_now"))
        if power_uw is not None:
            power = abs(power_uw) / 1e6
        elif current_ua is not None and volts:
            power = abs(current_ua) / 1e6 * volts  # drivers disagree on the sign

        capacity = _int(values.get("capacity"))
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
        t = _now_between(t0)
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


# --- Linux RAPL powercap --------------------------------------------------------------------

_RAPL_ZONE = re.compile(r"intel-rapl:\d+(:\d+)?")  # not intel-rapl-mmio: it repeats package-0


def rapl_delta_uj(prev: int, cur: int, max_range_uj: int) -> int:
    """Energy between two readings of a RAPL counter that wraps to 0 past `max_range_uj`.

    One wrap at most can be told apart, so sample at least once per wrap period (package-0's
    ~262 kJ range lasts 45 minutes at 100 W).
    """
    return cur - prev if cur >= prev else max_range_uj - prev + cur


def _rapl_permission_reason(path: Path) -> str:
    return (
        f"permission denied reading {path}: since Linux 5.10 RAPL energy counters are readable "
        "only by root (CVE-2020-8694, PLATYPUS); run as root, or grant read access with "
        "`sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj` (until reboot) or a udev "
        'rule: SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chmod o+r %S%p/energy_uj"'
    )


class RaplReader:
    """Summed RAPL energy counters (µJ → J), unwrapped across samples of this reader.

    `zones` are zone names to sum (`package-0`, `dram`, ...; a name shared by several sockets'
    zones sums them all). By default `psys` (the whole platform) where the machine has it, else
    every `package-N` plus `dram`: core and uncore lie inside the package and would count twice.
    """

    name = "rapl"

    def __init__(self, root: Path = Path("/sys/class/powercap"), zones: Sequence[str] = ()):
        self.root = Path(root)
        self.zones = tuple(zones)
        self._last: dict[Path, int] = {}  # raw counter at the previous sample
        self._total: dict[Path, int] = {}  # unwrapped counter
        self._max: dict[Path, int] = {}  # max_energy_range_uj

    def all_zones(self) -> list[tuple[str, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):
            if _RAPL_ZONE.fullmatch(path.name):
                try:
                    found.append(((path / "name").read_text().strip(), path))
                except OSError:
                    continue
        return found

    def chosen_zones(self) -> list[tuple[str, Path]]:
        zones = self.all_zones()
        names = {n for n, _ in zones}
        if self.zones:
            wanted = set(self.zones)
        elif "psys" in names:
            wanted = {"psys"}
        else:
            wanted = {n for n in names if n.startswith("package-") or n == "dram"}
        return [(n, p) for n, p in zones if n in wanted]

    def available(self) -> str | None:
        if not self.root.is_dir():
            return (
                f"no {self.root}: no powercap RAPL here (not Linux on x86, or the "
                "intel_rapl_msr module is not loaded)"
            )
        zones = self.chosen_zones()
        if not zones:
            have = ", ".join(sorted({n for n, _ in self.all_zones()})) or "none"
            want = ", ".join(self.zones) or "psys or package-N"
            return f"no RAPL zone named {want} under {self.root} (zones: {have})"
        for _, path in zones:
            try:
                int((path / "energy_uj").read_text())
            except PermissionError:
                return _rapl_permission_reason(path / "energy_uj")
            except (OSError, ValueError) as err:
                return f"cannot read {path / 'energy_uj'}: {err}"
        return None

    def _read(self, path: Path) -> int:
        """This zone's energy in µJ since the reader's first sample (plus that first reading)."""
        try:
            raw = int((path / "energy_uj").read_text())
            if path not in self._max:
                self._max[path] = int((path / "max_energy_range_uj").read_text())
        except PermissionError as err:
            raise ProbeUnavailable(_rapl_permission_reason(path / "energy_uj")) from err
        except (OSError, ValueError) as err:
            raise ProbeUnavailable(f"cannot read {path / 'energy_uj'}: {err}") from err
        last = self._last.get(path)
        if last is None:
            self._total[path] = raw
        else:
            self._total[path] += rapl_delta_uj(last, raw, self._max[path])
        self._last[path] = raw
        return self._total[path]

    def sample(self) -> EnergySample:
        zones = self.chosen_zones()
        if not zones:
            raise ProbeUnavailable(self.available() or "no RAPL zone")
        t0 = time.monotonic()
        total_uj = sum(self._read(path) for _, path in zones)
        return EnergySample(
            t=_now_between(t0), energy_j=total_uj / 1e6, source=self.name, cumulative=True
        )


# --- commands: adb and ioreg ------------------------------------------------------------------


def run_command(program: str, args: list[str], timeout: float = 10.0) -> str:
    """Runs `program args...` and returns stdout then stderr: error text is what the readers parse.

    Raises FileNotFoundError when the program is not installed, subprocess.TimeoutExpired.
    """
    proc = subprocess.run([program, *args], capture_output=True, text=True, timeout=timeout)
    return proc.stdout + proc.stderr


def adb_problem(text: str, serial: str | None) -> str | None:
    low = text.lower()
    if "no devices/emulators found" in low:
        return (
            "no Android device attached (`adb devices` lists none): connect one with USB "
            "debugging on, or `adb connect HOST:PORT`"
        )
    if "unauthorized" in low:
        return (
            "the Android device is unauthorized: accept the 'Allow USB debugging' prompt on its "
            "screen (if none shows, `adb kill-server` and reconnect)"
        )
    if "more than one device" in low:
        return "more than one Android device attached: pass the serial of one (`adb devices`)"
    if "device offline" in low:
        return "the Android device is offline: reconnect it (`adb reconnect`)"
    if serial is not None and "not found" in low and serial.lower() in low:
        return f"no Android device with serial {serial} (`adb devices` lists those attached)"
    if "cannot connect to daemon" in low or "failed to start daemon" in low:
        return f"the adb server did not start: {text.strip().splitlines()[-1]}"
    return None


def parse_dumpsys_battery(text: str) -> dict[str, str]:
    """`dumpsys battery`'s `key: value` lines, keys lower-cased; the first of repeated keys wins."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(": ")
        if sep:
            values.setdefault(key.lower(), value.strip())
    return values


class AdbReader:
    """An Android device's battery over adb: charge counter (µAh), voltage, current, level.

    `run` gets adb's arguments (after `adb`) and returns the output; by default it runs adb.
    `capacity_j` is estimated as charge counter / level: Android does not report full charge
    through these commands.
    """

    name = "android"
    SYSFS = "/sys/class/power_supply/battery"

    def __init__(self, run: Runner | None = None, serial: str | None = None, timeout: float = 10.0):
        self._run = run or (lambda args: run_command("adb", args, timeout))
        self.serial = serial
        self._volts_ref: float | None = None

    def _adb(self, *args: str) -> str:
        argv = (["-s", self.serial] if self.serial else []) + list(args)
        try:
            return self._run(argv)
        except FileNotFoundError as err:
            raise ProbeUnavailable("adb not found on PATH: install Android platform-tools") from err
        except subprocess.TimeoutExpired as err:
            raise ProbeUnavailable(f"`adb {' '.join(argv)}` did not answer in time") from err

    def _dumpsys(self) -> tuple[str, dict[str, str]]:
        text = self._adb("shell", "dumpsys", "battery")
        why = adb_problem(text, self.serial)
        if why is None and "Current Battery Service state" not in text:
            first = text.strip().splitlines()[0] if text.strip() else "nothing"
            why = f"unexpected `adb shell dumpsys battery` output: {first}"
        if why is not None:
            raise ProbeUnavailable(why)
        values = parse_dumpsys_battery(text)
        if values.get("present") == "false":
            raise ProbeUnavailable("the Android device reports no battery present")
        return text, values

    def available(self) -> str | None:
        try:
            self._dumpsys()
        except ProbeUnavailable as err:
            return err.reason
        return None

    def _cat(self, attr: str) -> int | None:
        """A sysfs value, or None when the file is missing or unreadable (SELinux, permissions)."""
        return _int(self._adb("shell", "cat", f"{self.SYSFS}/{attr}"))

    def sample(self) -> EnergySample:
        t0 = time.monotonic()
        text, d = self._dumpsys()
        current_ua = self._cat("current_now")
        voltage_uv = self._cat("voltage_now")
        counter_uah = self._cat("charge_counter")
        t = _now_between(t0)
        # `dumpsys battery unplug`/`set` freeze what dumpsys shows: trust only the sysfs then.
        frozen = "UPDATES STOPPED" in text
        if not counter_uah or counter_uah <= 0:
            counter_uah = None if frozen else _int(d.get("charge counter"))
            if counter_uah is not None and counter_uah <= 0:  # 0: the device has no counter
                counter_uah = None
        volts = voltage_uv / 1e6 if voltage_uv else None
        if volts is None and not frozen:
            mv = _int(d.get("voltage"))
            volts = mv / 1e3 if mv else None
        if self._volts_ref is None:
            self._volts_ref = volts
        vref = self._volts_ref

        pct = charging = None
        if not frozen:
            level, scale = _int(d.get("level")), _int(d.get("scale")) or 100
            pct = 100 * level / scale if level is not None else None
            powered = any(
                d.get(f"{k} powered") == "true" for k in ("ac", "usb", "wireless", "dock")
            )
            status = _int(d.get("status"))  # 2 charging, 3 discharging, 4 not charging, 5 full
            if powered or status in (2, 4, 5):
                charging = True
            elif status == 3:
                charging = False
        energy = counter_uah * UAH_TO_C * vref if counter_uah and vref else None
        capacity = 100 * energy / pct if energy is not None and pct else None
        power = abs(current_ua) / 1e6 * volts if current_ua is not None and volts else None
        return EnergySample(
            t=t,
            energy_j=energy,
            power_w=power,
            battery_pct=pct,
            charging=charging,
            source=self.name,
            capacity_j=capacity,
        )


def _ioreg_value(s: str, i: int) -> tuple[Any, int]:
    """Parses one ioreg value at s[i]: "text", {"k"=v,...}, (v,...), <hex>, Yes/No, numbers."""
    c = s[i]
    if c == '"':
        j = s.index('"', i + 1)
        return s[i + 1 : j], j + 1
    if c in "{(":
        close = "}" if c == "{" else ")"
        items: list[Any] = []
        keys: list[str] = []
        i += 1
        while i < len(s) and s[i] != close:
            if s[i] in ", ":
                i += 1
                continue
            if c == "{":
                key, i = _ioreg_value(s, i)
                i = s.index("=", i) + 1
                keys.append(key)
            value, i = _ioreg_value(s, i)
            items.append(value)
        return (dict(zip(keys, items, strict=True)) if c == "{" else items), i + 1
    if c == "<":
        j = s.index(">", i)
        return bytes.fromhex(s[i + 1 : j]), j + 1
    m = re.compile(r"[^,})\s]+").match(s, i)
    word = m.group(0) if m else ""
    end = i + max(len(word), 1)
    if word in ("Yes", "No"):
        return word == "Yes", end
    for kind in (int, float):
        try:
            return kind(word), end
        except ValueError:
            pass
    return word, end


def parse_ioreg(text: str) -> dict[str, Any]:
    """The properties of the first object in `ioreg -rn NAME` output, values parsed."""
    props: dict[str, Any] = {}
    for line in text.splitlines():
        m = re.match(r'^[\s|]*"([^"]+)" = (.+?)\s*$', line)
        if m:
            if m.group(1) in props:  # a second object's block: keep the first
                break
            try:
                props[m.group(1)] = _ioreg_value(m.group(2), 0)[0]
            except (ValueError, IndexError):
                props[m.group(1)] = m.group(2)
    return props


def _signed64(value: Any) -> int | None:
    """ioreg prints a negative current as its unsigned 64-bit two's complement."""
    if not isinstance(value, int):
        return None
    return value - 2**64 if value >= 2**63 else value


class IoregReader:
    """A Mac's battery from `ioreg -rn AppleSmartBattery`.

    Apple silicon reports CurrentCapacity/MaxCapacity in percent and the charge in
    AppleRawCurrentCapacity/AppleRawMaxCapacity (mAh); Intel Macs report mAh in the former.
    Voltage is in mV, Amperage/InstantAmperage in mA (negative while discharging).
    `run` gets ioreg's arguments and returns its output; by default it runs ioreg.
    """

    name = "macos"

    def __init__(self, run: Runner | None = None, timeout: float = 10.0):
        self._injected = run is not None
        self._run = run or (lambda args: run_command("ioreg", args, timeout))
        self._volts_ref: float | None = None

    def _props(self) -> dict[str, Any]:
        if not self._injected and sys.platform != "darwin":
            raise ProbeUnavailable("needs macOS (ioreg)")
        try:
            text = self._run(["-rn", "AppleSmartBattery"])
        except FileNotFoundError as err:
            raise ProbeUnavailable("needs macOS (ioreg not found)") from err
        except subprocess.TimeoutExpired as err:
            raise ProbeUnavailable("ioreg did not answer in time") from err
        props = parse_ioreg(text)
        if "Voltage" not in props and "CurrentCapacity" not in props:
            raise ProbeUnavailable("ioreg lists no AppleSmartBattery (a Mac without a battery)")
        return props

    def available(self) -> str | None:
        try:
            self._props()
        except ProbeUnavailable as err:
            return err.reason
        return None

    def sample(self) -> EnergySample:
        t0 = time.monotonic()
        p = self._props()
        t = _now_between(t0)
        mv = p.get("Voltage") if isinstance(p.get("Voltage"), int) else None
        volts = mv / 1e3 if mv else None
        if self._volts_ref is None:
            self._volts_ref = volts
        vref = self._volts_ref

        cur, mx = p.get("CurrentCapacity"), p.get("MaxCapacity")
        in_mah = isinstance(mx, int) and mx > 100  # Intel Macs: mAh, not percent
        charge_mah = p.get("AppleRawCurrentCapacity", cur if in_mah else None)
        full_mah = p.get("AppleRawMaxCapacity", mx if in_mah else None)
        pct = None
        if isinstance(cur, int) and isinstance(mx, int) and mx > 0:
            pct = 100 * cur / mx

        ma = _signed64(p.get("InstantAmperage"))
        if ma is None:
            ma = _signed64(p.get("Amperage"))
        power = abs(ma) * volts / 1e3 if ma is not None and volts else None
        mah_to_j = 1e3 * UAH_TO_C * vref if vref else None
        energy = charge_mah * mah_to_j if isinstance(charge_mah, int) and mah_to_j else None
        full = full_mah * mah_to_j if isinstance(full_mah, int) and mah_to_j else None
        flags = [p.get("IsCharging"), p.get("ExternalConnected")]
        charging = True if True in flags else (False if False in flags else None)
        return EnergySample(
            t=t,
            energy_j=energy,
            power_w=power,
            battery_pct=pct,
            charging=charging,
            source=self.name,
            capacity_j=full,
        )


# --- choosing a source, and the report ---------------------------------------------------------


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

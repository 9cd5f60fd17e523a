"""An Android device's battery over adb: `dumpsys battery` plus
`/sys/class/power_supply/battery/{current_now,voltage_now,charge_counter}`, and the plain-words
reason behind each way adb fails (no device, unauthorized, several, offline).
"""

from __future__ import annotations

import subprocess
import time

from edgemtp.runtime.probes.sample import (
    UAH_TO_C,
    EnergySample,
    ProbeUnavailable,
    Runner,
    int_or_none,
    reading_time,
    run_command,
    unavailable_reason,
)


def adb_problem(text: str, serial: str | None) -> str | None:
    """What went wrong, from adb's output, and how to fix it; None when nothing did."""
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
        return unavailable_reason(self._dumpsys)

    def _cat(self, attr: str) -> int | None:
        """A sysfs value, or None when the file is missing or unreadable (SELinux, permissions)."""
        return int_or_none(self._adb("shell", "cat", f"{self.SYSFS}/{attr}"))

    def sample(self) -> EnergySample:
        t0 = time.monotonic()
        text, d = self._dumpsys()
        current_ua = self._cat("current_now")
        voltage_uv = self._cat("voltage_now")
        counter_uah = self._cat("charge_counter")
        t = reading_time(t0)
        # `dumpsys battery unplug`/`set` freeze what dumpsys shows: trust only the sysfs then.
        frozen = "UPDATES STOPPED" in text
        if not counter_uah or counter_uah <= 0:
            counter_uah = None if frozen else int_or_none(d.get("charge counter"))
            if counter_uah is not None and counter_uah <= 0:  # 0: the device has no counter
                counter_uah = None
        volts = voltage_uv / 1e6 if voltage_uv else None
        if volts is None and not frozen:
            mv = int_or_none(d.get("voltage"))
            volts = mv / 1e3 if mv else None
        if self._volts_ref is None:
            self._volts_ref = volts
        vref = self._volts_ref

        pct = charging = None
        if not frozen:
            level, scale = int_or_none(d.get("level")), int_or_none(d.get("scale")) or 100
            pct = 100 * level / scale if level is not None else None
            powered = any(
                d.get(f"{k} powered") == "true" for k in ("ac", "usb", "wireless", "dock")
            )
            status = int_or_none(
                d.get("status")
            )  # 2 charging, 3 discharging, 4 not charging, 5 full
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

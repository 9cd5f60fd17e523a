"""A Mac's battery from `ioreg -rn AppleSmartBattery`, and a parser for ioreg's property
listing (strings, numbers, Yes/No, data, nested dicts and lists).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

from edgemtp.runtime.probes.sample import (
    UAH_TO_C,
    EnergySample,
    ProbeUnavailable,
    Runner,
    reading_time,
    run_command,
    unavailable_reason,
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
        return unavailable_reason(self._props)

    def sample(self) -> EnergySample:
        t0 = time.monotonic()
        p = self._props()
        t = reading_time(t0)
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

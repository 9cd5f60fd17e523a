"""Linux powercap RAPL: `/sys/class/powercap/intel-rapl:N[:M]/energy_uj`, cumulative energy
counters (µJ) that wrap at `max_energy_range_uj`; the reader unwraps and sums the zones that
cover the machine without counting any part twice.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

from edgemtp.runtime.probes.sample import EnergySample, ProbeUnavailable, reading_time

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
            t=reading_time(t0), energy_j=total_uj / 1e6, source=self.name, cumulative=True
        )

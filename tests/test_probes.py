"""Energy and memory probes against recorded sysfs trees and command outputs.

Expected numbers are worked out by hand from the recorded values, in the sources' own units.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edgemtp.runtime.probes import (
    AdbReader,
    EnergySample,
    IoregReader,
    PowerSupplyReader,
    ProbeUnavailable,
    RaplReader,
    Unavailable,
    current_rss_mb,
    detect,
    energy_report,
    integrate_power,
    parse_ioreg,
    peak_rss_mb,
    rapl_delta_uj,
)
from edgemtp.runtime.probes.memory import maxrss_to_mb

DATA = Path(__file__).parent / "data" / "probes"
ADB = DATA / "adb"
SYSFS = "/sys/class/power_supply/battery"
REPORT_KEYS = {
    "source",
    "energy_j",
    "j_per_token",
    "avg_power_w",
    "battery_pct_per_1k_tokens",
    "reason",
}


def copy_tree(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name.replace("/", "_")))


def write(path: Path, value: int) -> None:
    path.write_text(f"{value}\n")


def as_json(report: dict) -> dict:
    assert set(report) == REPORT_KEYS
    return json.loads(json.dumps(report, allow_nan=False))


# --- Linux power_supply ----------------------------------------------------------------------


def test_laptop_energy_battery(tmp_path):
    root = copy_tree("power_supply/laptop", tmp_path)
    reader = PowerSupplyReader(root)
    assert reader.available() is None
    # the mouse battery (scope Device) and the AC adapter are not system batteries
    assert [p.name for p, _ in reader.batteries()] == ["BAT0"]
    s0 = reader.sample()
    assert s0.energy_j == pytest.approx(38.62 * 3600)  # energy_now 38620000 µWh
    assert s0.capacity_j == pytest.approx(51.21 * 3600)  # energy_full 51210000 µWh
    assert s0.power_w == pytest.approx(7.432)  # power_now 7432000 µW
    assert s0.battery_pct == 75 and s0.charging is False and not s0.cumulative
    assert s0.source == "power_supply"

    write(root / "BAT0" / "energy_now", 38574000)  # 46 mWh later
    s1 = reader.sample()
    assert s1.t >= s0.t
    start, end = dataclasses.replace(s0, t=100.0), dataclasses.replace(s1, t=130.0)
    report = as_json(energy_report(start, end, tokens=512))
    used = 0.046 * 3600  # 165.6 J
    assert report["energy_j"] == pytest.approx(used)
    assert report["j_per_token"] == pytest.approx(used / 512)
    assert report["avg_power_w"] == pytest.approx(used / 30)
    assert report["battery_pct_per_1k_tokens"] == pytest.approx(
        used / 512 * 1000 / (51.21 * 3600) * 100
    )
    assert report["source"] == "power_supply" and report["reason"] is None

    write(root / "BAT0" / "energy_now", 38620000)
    (root / "BAT0" / "status").write_text("Charging\n")
    charging = reader.sample()
    assert charging.charging is True
    report = as_json(energy_report(start, dataclasses.replace(charging, t=130.0), tokens=512))
    assert report["energy_j"] is None and report["j_per_token"] is None
    assert "charging" in report["reason"]


def test_charge_only_battery_uses_one_voltage(tmp_path):
    root = copy_tree("power_supply/bq27441", tmp_path)
    reader = PowerSupplyReader(root)
    s0 = reader.sample()
    # charge_now 2143000 µAh at voltage_now 3812000 µV; current_now -612000 µA (discharging)
    assert s0.energy_j == pytest.approx(2.143 * 3600 * 3.812)
    assert s0.capacity_j == pytest.approx(2.950 * 3600 * 3.812)
    assert s0.power_w == pytest.approx(0.612 * 3.812)
    assert s0.battery_pct == 72 and s0.charging is False

    bat = root / "bq27441-0"
    write(bat / "charge_now", 2141500)  # 1.5 mAh used while the voltage sagged to 3.75 V
    write(bat / "voltage_now", 3750000)
    s1 = reader.sample()
    assert s0.energy_j - s1.energy_j == pytest.approx(0.0015 * 3600 * 3.812)  # 20.58 J, not ~500
    assert s1.power_w == pytest.approx(0.612 * 3.75)
    report = energy_report(s0, dataclasses.replace(s1, t=s0.t + 10), tokens=100)
    assert report["j_per_token"] == pytest.approx(0.0015 * 3600 * 3.812 / 100)


def test_uevent_alone_gives_the_same_reading(tmp_path):
    root = copy_tree("power_supply/bq27441", tmp_path)
    full = PowerSupplyReader(root).sample()
    for f in (root / "bq27441-0").iterdir():
        if f.name != "uevent":
            f.unlink()
    alone = PowerSupplyReader(root).sample()
    assert alone.energy_j == pytest.approx(2.143 * 3600 * 3.812)
    assert dataclasses.replace(alone, t=full.t) == full


def test_two_batteries_are_summed(tmp_path):
    root = tmp_path / "ps"
    shutil.copytree(DATA / "power_supply/laptop/BAT0", root / "BAT0")
    shutil.copytree(DATA / "power_supply/bq27441/bq27441-0", root / "bq27441-0")
    s = PowerSupplyReader(root).sample()
    energy = 38.62 * 3600 + 2.143 * 3600 * 3.812
    full = 51.21 * 3600 + 2.950 * 3600 * 3.812
    assert s.energy_j == pytest.approx(energy)
    assert s.power_w == pytest.approx(7.432 + 0.612 * 3.812)
    assert s.battery_pct == pytest.approx(100 * energy / full)


def test_power_supply_unavailable(tmp_path):
    assert "no " in PowerSupplyReader(tmp_path / "missing").available()
    (tmp_path / "empty").mkdir()
    reader = PowerSupplyReader(tmp_path / "empty")
    assert "no system battery" in reader.available()
    with pytest.raises(ProbeUnavailable, match="^unavailable: no system battery"):
        reader.sample()
    root = copy_tree("power_supply/laptop", tmp_path)
    (root / "BAT0" / "present").write_text("0\n")  # battery bay empty
    assert "no system battery" in PowerSupplyReader(root).available()


# --- RAPL ----------------------------------------------------------------------------------------


def test_rapl_zones():
    root = DATA / "powercap"
    # psys (the whole platform) where there is one
    assert RaplReader(root).sample().energy_j == pytest.approx(148920.334971)
    # package-0 once: intel-rapl-mmio:0 repeats it, core and uncore lie inside it
    package = RaplReader(root, zones=["package-0"]).sample()
    assert package.energy_j == pytest.approx(81356.102367) and package.cumulative
    assert package.power_w is None and package.battery_pct is None
    reason = RaplReader(root, zones=["dram"]).available()
    assert "dram" in reason and "package-0" in reason


def test_rapl_without_psys_sums_packages(tmp_path):
    root = copy_tree("powercap", tmp_path)
    shutil.rmtree(root / "intel-rapl:1")
    assert RaplReader(root).sample().energy_j == pytest.approx(81356.102367)


def test_rapl_delta_wraps():
    assert rapl_delta_uj(1_000, 5_000, 262_143_328_850) == 4_000
    assert rapl_delta_uj(262_143_000_000, 1_200_000, 262_143_328_850) == 328_850 + 1_200_000
    assert rapl_delta_uj(7, 7, 100) == 0


def test_rapl_reader_unwraps(tmp_path):
    root = copy_tree("powercap", tmp_path)
    counter = root / "intel-rapl:0" / "energy_uj"
    reader = RaplReader(root, zones=["package-0"])
    write(counter, 262_143_000_000)
    s0 = reader.sample()
    write(counter, 1_200_000)  # wrapped past max_energy_range_uj 262143328850
    s1 = reader.sample()
    write(counter, 2_200_000)
    s2 = reader.sample()
    assert s1.energy_j - s0.energy_j == pytest.approx(1.52885)  # 328850 + 1200000 µJ
    assert s2.energy_j - s1.energy_j == pytest.approx(1.0)
    report = as_json(
        energy_report(dataclasses.replace(s0, t=0.0), dataclasses.replace(s2, t=0.5), tokens=4)
    )
    assert report["energy_j"] == pytest.approx(2.52885)
    assert report["avg_power_w"] == pytest.approx(2.52885 / 0.5)
    assert report["j_per_token"] == pytest.approx(2.52885 / 4)
    assert report["battery_pct_per_1k_tokens"] is None
    assert "battery capacity unknown" in report["reason"]
    with_battery = energy_report(
        dataclasses.replace(s0, t=0.0), dataclasses.replace(s2, t=0.5), 4, battery_wh=50
    )
    assert with_battery["battery_pct_per_1k_tokens"] == pytest.approx(
        2.52885 / 4 * 1000 / (50 * 3600) * 100
    )
    assert with_battery["reason"] is None


def test_rapl_permission_denied(tmp_path, monkeypatch):
    root = copy_tree("powercap", tmp_path)
    for zone in root.glob("intel-rapl*:*"):
        (zone / "energy_uj").chmod(0o000)
    # tests run as root, which mode 000 does not stop: deny the read as the kernel would
    real_read_text = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "energy_uj" and not self.stat().st_mode & 0o444:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    reader = RaplReader(root)
    reason = reader.available()
    assert "permission denied" in reason and "intel-rapl:1/energy_uj" in reason
    assert "root" in reason and "chmod" in reason and "udev" in reason
    with pytest.raises(ProbeUnavailable) as err:
        reader.sample()
    assert err.value.reason == reason

    # detect() falls back to the battery, and says why when there is none
    picked = detect(
        platform="linux", powercap_root=root, power_supply_root=DATA / "power_supply/laptop"
    )
    assert isinstance(picked, PowerSupplyReader)
    none = detect(platform="linux", powercap_root=root, power_supply_root=tmp_path / "none")
    assert isinstance(none, Unavailable)
    assert none.reason.startswith("rapl: permission denied") and "power_supply: no " in none.reason


# --- Android over adb ------------------------------------------------------------------------


def replay(outputs: dict[tuple[str, ...], str], calls: list | None = None):
    def run(args: list[str]) -> str:
        if calls is not None:
            calls.append(args)
        return outputs[tuple(args)]

    return run


def adb_outputs(dumpsys: str, cats: dict[str, str]) -> dict[tuple[str, ...], str]:
    outputs = {("shell", "dumpsys", "battery"): (ADB / dumpsys).read_text()}
    for attr in ("current_now", "voltage_now", "charge_counter"):
        outputs[("shell", "cat", f"{SYSFS}/{attr}")] = (ADB / cats[attr]).read_text()
    return outputs


DISCHARGING_CATS = {
    a: f"{a}_discharging.txt" for a in ("current_now", "voltage_now", "charge_counter")
}
DENIED_CATS = dict.fromkeys(DISCHARGING_CATS, "cat_permission_denied.txt")


def test_adb_discharging():
    calls: list = []
    reader = AdbReader(
        replay(adb_outputs("dumpsys_battery_discharging.txt", DISCHARGING_CATS), calls)
    )
    assert reader.available() is None
    s = reader.sample()
    # charge_counter 3610240 µAh at voltage_now 4168750 µV; current_now -487312 µA
    assert s.energy_j == pytest.approx(3.61024 * 3600 * 4.16875)
    assert s.power_w == pytest.approx(0.487312 * 4.16875)
    assert s.battery_pct == 81 and s.charging is False and s.source == "android"
    assert s.capacity_j == pytest.approx(3.61024 * 3600 * 4.16875 / 0.81)
    assert ["shell", "cat", f"{SYSFS}/charge_counter"] in calls

    serial_calls: list = []
    outputs = {
        ("-s", "R58N12ABCDE", *k): v
        for k, v in adb_outputs("dumpsys_battery_discharging.txt", DISCHARGING_CATS).items()
    }
    AdbReader(replay(outputs, serial_calls), serial="R58N12ABCDE").sample()
    assert all(c[:2] == ["-s", "R58N12ABCDE"] for c in serial_calls)


def test_adb_energy_drop_uses_the_first_voltage():
    outputs = adb_outputs("dumpsys_battery_discharging.txt", DISCHARGING_CATS)
    reader = AdbReader(replay(outputs))
    s0 = reader.sample()
    outputs[("shell", "cat", f"{SYSFS}/charge_counter")] = "3608240\n"  # 2 mAh later
    outputs[("shell", "cat", f"{SYSFS}/voltage_now")] = "4101250\n"  # sagged under load
    s1 = reader.sample()
    assert s0.energy_j - s1.energy_j == pytest.approx(0.002 * 3600 * 4.16875)
    assert s1.power_w == pytest.approx(0.487312 * 4.10125)


def test_adb_falls_back_to_dumpsys_when_sysfs_is_closed():
    reader = AdbReader(replay(adb_outputs("dumpsys_battery_discharging.txt", DENIED_CATS)))
    s = reader.sample()
    # "Charge counter: 3612000" µAh at "voltage: 4172" mV; no current, so no power
    assert s.energy_j == pytest.approx(3.612 * 3600 * 4.172)
    assert s.power_w is None and s.battery_pct == 81


def test_adb_charging_over_usb():
    reader = AdbReader(replay(adb_outputs("dumpsys_battery_charging.txt", DENIED_CATS)))
    s = reader.sample()
    assert s.charging is True and s.battery_pct == 82
    start = EnergySample(t=0.0, energy_j=54000.0, charging=False, source="android")
    report = as_json(energy_report(start, dataclasses.replace(s, t=60.0), tokens=100))
    assert report["energy_j"] is None and "charging" in report["reason"]

    # a weak USB port: the phone still discharges, yet the port feeds it
    outputs = adb_outputs("dumpsys_battery_discharging.txt", DENIED_CATS)
    key = ("shell", "dumpsys", "battery")
    outputs[key] = outputs[key].replace("USB powered: false", "USB powered: true")
    assert AdbReader(replay(outputs)).sample().charging is True


def test_adb_frozen_dumpsys_is_not_trusted():
    reader = AdbReader(replay(adb_outputs("dumpsys_battery_updates_stopped.txt", DISCHARGING_CATS)))
    s = reader.sample()
    assert s.battery_pct is None and s.charging is None  # level 82 / unplugged are fakes
    assert s.energy_j == pytest.approx(3.61024 * 3600 * 4.16875)  # sysfs is live


@pytest.mark.parametrize(
    ("recording", "words"),
    [
        ("adb_unauthorized.txt", "accept the 'Allow USB debugging' prompt"),
        ("adb_no_devices.txt", "no Android device attached"),
        ("adb_more_than_one.txt", "pass the serial"),
    ],
)
def test_adb_errors(recording, words):
    run = replay({("shell", "dumpsys", "battery"): (ADB / recording).read_text()})
    reader = AdbReader(run)
    assert words in reader.available()
    with pytest.raises(ProbeUnavailable, match=words):
        reader.sample()
    picked = detect(android=True, adb_run=run)
    assert isinstance(picked, Unavailable) and words in picked.reason


def test_adb_missing_binary_and_timeout():
    def missing(args):
        raise FileNotFoundError(2, "No such file or directory", "adb")

    def hangs(args):
        raise subprocess.TimeoutExpired(["adb", *args], 10)

    assert "adb not found" in AdbReader(missing).available()
    assert "did not answer" in AdbReader(hangs).available()
    ok = adb_outputs("dumpsys_battery_discharging.txt", DISCHARGING_CATS)
    assert isinstance(detect(android=True, adb_run=replay(ok)), AdbReader)


# --- macOS ioreg -----------------------------------------------------------------------------

IOREG = (DATA / "ioreg" / "applesmartbattery_discharging.txt").read_text()


def test_parse_ioreg():
    props = parse_ioreg(IOREG)
    assert props["CurrentCapacity"] == 78 and props["built-in"] is True
    assert props["IsCharging"] is False and props["DeviceName"] == "bq40z651"
    assert props["BatteryData"]["CellVoltage"] == [4171, 4170, 4171]
    assert props["BatteryData"]["Serial"] == "F5D2231HA5NQ1NDAJ"
    assert props["AppleRawAdapterDetails"][0]["IsWireless"] is False
    assert props["BatteryFCCData"] == bytes([1, 2, 3, 4])
    assert props["Amperage"] == 2**64 - 1097


def test_ioreg_apple_silicon_discharging():
    calls: list = []
    s = IoregReader(replay({("-rn", "AppleSmartBattery"): IOREG}, calls)).sample()
    # AppleRawCurrentCapacity 3612 mAh, Voltage 12512 mV, InstantAmperage -1144 mA
    assert s.energy_j == pytest.approx(3.612 * 3600 * 12.512)
    assert s.capacity_j == pytest.approx(4.198 * 3600 * 12.512)  # AppleRawMaxCapacity
    assert s.power_w == pytest.approx(1.144 * 12.512)
    assert s.battery_pct == 78 and s.charging is False and s.source == "macos"
    assert calls == [["-rn", "AppleSmartBattery"]]

    plugged = IOREG.replace('"ExternalConnected" = No', '"ExternalConnected" = Yes')
    assert IoregReader(replay({("-rn", "AppleSmartBattery"): plugged})).sample().charging is True


def test_ioreg_intel_mac_reports_mah():
    text = """+-o AppleSmartBattery  <class AppleSmartBattery, id 0x1000002a4, registered>
    {
      "CurrentCapacity" = 3890
      "MaxCapacity" = 5200
      "Voltage" = 12100
      "Amperage" = 18446744073709550495
      "IsCharging" = No
      "ExternalConnected" = No
    }
"""
    s = IoregReader(replay({("-rn", "AppleSmartBattery"): text})).sample()
    assert s.battery_pct == pytest.approx(100 * 3890 / 5200)
    assert s.energy_j == pytest.approx(3.890 * 3600 * 12.1)
    assert s.power_w == pytest.approx(1.121 * 12.1)  # Amperage -1121 mA


def test_ioreg_unavailable():
    assert IoregReader().available() == "needs macOS (ioreg)"  # this host is Linux
    empty = IoregReader(replay({("-rn", "AppleSmartBattery"): ""}))
    assert "no AppleSmartBattery" in empty.available()
    picked = detect(platform="darwin", ioreg_run=replay({("-rn", "AppleSmartBattery"): IOREG}))
    assert isinstance(picked, IoregReader)
    windows = detect(platform="win32")
    assert isinstance(windows, Unavailable) and "win32" in windows.reason


# --- reports ---------------------------------------------------------------------------------


def test_integrate_power_trapezoid():
    samples = [EnergySample(t=3.0, power_w=4.0), EnergySample(t=0.0, power_w=2.0)]
    samples.append(EnergySample(t=1.0, power_w=4.0))
    samples.append(EnergySample(t=2.0))  # no power: skipped
    assert integrate_power(samples) == pytest.approx((2 + 4) / 2 * 1 + (4 + 4) / 2 * 2)
    assert integrate_power(samples[:1]) is None


def test_report_from_power_only():
    start = EnergySample(t=0.0, power_w=2.0, charging=False, source="x")
    mid = EnergySample(t=1.0, power_w=4.0, charging=False, source="x")
    end = EnergySample(t=3.0, power_w=4.0, charging=False, source="x", capacity_j=36000.0)
    report = as_json(energy_report(start, end, tokens=22, power_samples=[mid]))
    assert report["energy_j"] == pytest.approx(11.0)
    assert report["j_per_token"] == pytest.approx(0.5)
    assert report["avg_power_w"] == pytest.approx(11 / 3)
    assert report["battery_pct_per_1k_tokens"] == pytest.approx(0.5 * 1000 / 36000 * 100)
    assert report["reason"] is None


def test_report_reasons():
    c0 = EnergySample(t=0.0, energy_j=10.0, source="rapl", cumulative=True)
    still = as_json(energy_report(c0, dataclasses.replace(c0, t=5.0), tokens=10))
    assert still["energy_j"] is None and "did not move" in still["reason"]

    b0 = EnergySample(t=0.0, energy_j=5000.0, charging=False, source="power_supply")
    flat = as_json(energy_report(b0, dataclasses.replace(b0, t=5.0), tokens=10))
    assert flat["energy_j"] is None and "run longer" in flat["reason"]

    none = as_json(energy_report(c0, dataclasses.replace(c0, t=5.0, energy_j=12.0), tokens=0))
    assert none["energy_j"] == 2.0 and none["j_per_token"] is None
    assert "no tokens" in none["reason"]

    mixed = as_json(energy_report(c0, dataclasses.replace(b0, t=5.0), tokens=10))
    assert mixed["source"] is None and mixed["reason"].startswith("unavailable: ")


def test_unavailable_report_json():
    report = Unavailable("needs macOS (ioreg)").report()
    assert json.loads(json.dumps(report)) == {
        "source": None,
        "energy_j": None,
        "j_per_token": None,
        "avg_power_w": None,
        "battery_pct_per_1k_tokens": None,
        "reason": "unavailable: needs macOS (ioreg)",
    }
    with pytest.raises(ProbeUnavailable, match="unavailable: needs macOS"):
        Unavailable("needs macOS (ioreg)").sample()


def test_detect_on_this_host():
    picked = detect()
    why = picked.available()
    if isinstance(picked, Unavailable):
        assert why and as_json(picked.report())["reason"] == f"unavailable: {why}"
    else:
        assert why is None and isinstance(picked.sample(), EnergySample)


# --- memory ----------------------------------------------------------------------------------


def test_maxrss_units():
    assert maxrss_to_mb(2048, "linux") == 2.0  # kB
    assert maxrss_to_mb(2 * 2**20, "darwin") == 2.0  # bytes


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux procfs")
def test_rss_follows_a_200_mb_allocation():
    before = current_rss_mb()
    buf = bytearray(200 * 2**20)
    buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))  # touch every page
    during = current_rss_mb()
    assert 190 < during - before < 215
    status = Path("/proc/self/status").read_text()
    vm_rss = int(status.split("VmRSS:")[1].split()[0]) / 1024  # kB
    vm_hwm = int(status.split("VmHWM:")[1].split()[0]) / 1024
    assert abs(during - vm_rss) < 2
    peak = peak_rss_mb()
    assert peak >= during - 1 and abs(peak - vm_hwm) < 2
    del buf
    assert current_rss_mb() < during - 150  # the pages went back
    assert peak_rss_mb() >= peak  # the high-water mark stays
    assert os.sysconf("SC_PAGE_SIZE") > 0

"""Device profiles: every shipped profile loads, every number is traced to a source or an
estimate with its reasoning, the numbers are physically plausible, and a bad file is refused with
one line naming the file and the field."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from edgemtp.devices.profiles import (
    DTYPES,
    ESTIMATE,
    MIN_NOTE_CHARS,
    PROFILE_DIR,
    list_profiles,
    load_profile,
)
from edgemtp.errors import EdgeMTPError

PHONES = {
    "galaxy-s26-ultra", "galaxy-s26-plus", "pixel-10-pro", "iphone-17-pro", "dimensity-9000-plus"
}  # fmt: skip
LAPTOPS = {"macbook-pro-m4", "macbook-pro-m4-pro", "laptop-i7-10750h"}
BOARDS = {"raspberry-pi-5"}
EXPECTED_DELEGATES = {
    "galaxy-s26-ultra": {"cpu", "gpu", "htp"},
    "galaxy-s26-plus": {"cpu", "gpu", "htp"},
    "pixel-10-pro": {"cpu", "gpu", "npu"},
    "iphone-17-pro": {"cpu", "metal", "npu"},
    "macbook-pro-m4": {"cpu", "metal", "npu"},
    "macbook-pro-m4-pro": {"cpu", "metal", "npu"},
    "raspberry-pi-5": {"cpu"},
    # a published benchmark's machines, profiled for their CPU figures
    "dimensity-9000-plus": {"cpu"},
    "laptop-i7-10750h": {"cpu"},
}
ACCELERATORS = ("npu", "htp")

GOOD = """\
name = "Test phone"
soc = "Test SoC"
memory = "LPDDR5X-8533, 64-bit"
ram_gb = { value = 8, source = "https://example.com/spec", note = "vendor spec sheet, 8 GB" }
battery_wh = { value = 15.0, source = "estimate", note = "4000 mAh x 3.85 V = 15.4, rounded" }
idle_w = { value = 0.6, source = "estimate", note = "screen on, low brightness, idle" }

[delegates.cpu]
unit = "4 big cores"
dispatch_unit = "kernel"
threads = { value = 4, source = "estimate", note = "runtime uses the four big cores" }
memory_bandwidth_gbs = { value = 40, source = "estimate", note = "68.3 GB/s peak x 0.6 = 41" }
peak_memory_bandwidth_gbs = { value = 68.3, source = "https://ex.com/s", note = "8533 MT/s x 8 B" }
dispatch_us = { value = 5, source = "estimate", note = "thread-pool fork-join, a few us" }
active_w = { value = 5, source = "estimate", note = "sustained phone CPU envelope" }

[delegates.cpu.peak_tops]
int8 = { value = 2.0, source = "estimate", note = "4 cores x 2 GHz x 256 ops/cycle" }
"""


def _all_profiles():
    """The shipped profiles (not the ones `devices calibrate` wrote on this machine)."""
    return {path.stem: load_profile(path) for path in sorted(PROFILE_DIR.glob("*.toml"))}


def _leaf_numbers(table: dict, prefix: str = "") -> dict[str, dict]:
    """Dotted path -> inline number table, for every {value, source, note} in a raw TOML."""
    found = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and "value" in value:
            found[path] = value
        elif isinstance(value, dict):
            found.update(_leaf_numbers(value, path + "."))
    return found


def test_every_shipped_profile_loads_with_the_expected_delegates():
    profiles = _all_profiles()
    assert set(profiles) == PHONES | LAPTOPS | BOARDS
    assert set(profiles) <= set(list_profiles())  # with any this machine calibrated
    for key, profile in profiles.items():
        assert profile.key == key
        assert profile.path == PROFILE_DIR / f"{key}.toml"
        assert set(profile.delegates) == EXPECTED_DELEGATES[key], key
        assert profile.name and profile.soc and profile.memory
        for name, delegate in profile.delegates.items():
            assert delegate.name == name
            assert delegate.unit
            assert delegate.dispatch_unit in ("kernel", "graph")
            assert delegate.peak_tops and set(delegate.peak_tops) <= set(DTYPES)
            assert all(isinstance(v, float) for v in delegate.peak_tops.values())
        # a CPU delegate pays per kernel, an NPU per graph
        assert profile.delegates["cpu"].dispatch_unit == "kernel"
        assert profile.delegates["cpu"].threads is not None
        for name in ACCELERATORS:
            if name in profile.delegates:
                assert profile.delegates[name].dispatch_unit == "graph"


def test_every_number_has_a_source_or_an_estimate_with_its_reasoning():
    for key, profile in _all_profiles().items():
        raw = tomllib.loads(profile.path.read_text(encoding="utf-8"))
        leaves = _leaf_numbers(raw)
        assert leaves, key
        # every number in the file is recorded, with the same source and (normalised) note
        for path, entry in leaves.items():
            source, note = profile.source(path)
            assert source == entry["source"].strip()
            assert note == " ".join(entry["note"].split())
            assert len(note) >= MIN_NOTE_CHARS
            if source == ESTIMATE:
                # an estimate shows where it came from: a number or a reference in its reasoning
                assert re.search(r"\d", note), (key, path, note)
            else:
                assert source.startswith("http") or len(source.split()) >= 3, (key, path, source)
        # and nothing is recorded that is not in the file, except the inherited delegate idle_w
        extra = set(profile.sources) - set(leaves)
        assert all(p.startswith("delegates.") and p.endswith(".idle_w") for p in extra), extra
        for name, delegate in profile.delegates.items():
            assert profile.source(f"delegates.{name}.idle_w") == profile.source("idle_w")
            assert delegate.idle_w == profile.idle_w
        assert set(profile.estimates()) <= set(profile.sources)


def test_numbers_are_positive_and_physically_plausible():
    for key, p in _all_profiles().items():
        assert p.ram_gb in (8, 12, 16, 24, 32, 48, 64), key
        if key in BOARDS:
            assert p.battery_wh is None  # mains-powered
            bandwidth = (5, 40)
        elif key in PHONES:
            assert 10 <= p.battery_wh <= 25, key  # phone packs, mAh x ~3.88 V
            assert 0.2 <= p.idle_w <= 2, key
            bandwidth = (20, 200)
        else:
            assert 50 <= p.battery_wh <= 100, key  # laptop packs
            assert 2 <= p.idle_w <= 15, key
            bandwidth = (30, 600)  # dual-channel DDR4 up to an M4 Max
        for name, d in p.delegates.items():
            where = f"{key}:{name}"
            assert bandwidth[0] <= d.memory_bandwidth_gbs <= bandwidth[1], where
            assert bandwidth[0] <= d.peak_memory_bandwidth_gbs <= bandwidth[1], where
            # sustained is a real fraction of the bus peak, never above it
            assert 0.3 <= d.memory_bandwidth_gbs / d.peak_memory_bandwidth_gbs <= 0.95, where
            for dtype, tops in d.peak_tops.items():
                assert 0.05 <= tops <= 300 and math.isfinite(tops), (where, dtype)
            if "fp16" in d.peak_tops and "fp32" in d.peak_tops:
                assert d.peak_tops["fp16"] >= d.peak_tops["fp32"], where
            if "int4" in d.peak_tops:
                assert d.peak_tops["int4"] >= d.peak_tops["int8"], where
            assert 1 <= d.dispatch_us <= 5000, where
            assert 0.5 <= d.active_w <= 60, where
            if d.peak_w is not None:
                assert d.peak_w >= d.active_w * 0.8, where
            if d.threads is not None:
                assert 1 <= d.threads <= 16, where
        # all delegates share one memory bus
        peaks = {d.peak_memory_bandwidth_gbs for d in p.delegates.values()}
        assert len(peaks) == 1, key


def test_accelerators_outrun_the_cpu_and_devices_rank_sensibly():
    profiles = _all_profiles()
    for key, p in profiles.items():
        cpu = p.delegates["cpu"]
        for name in ACCELERATORS:
            if name in p.delegates:
                assert p.delegates[name].peak_tops["int8"] > 3 * cpu.peak_tops["int8"], (key, name)
        for name in ("gpu", "metal"):  # a GPU without int8 units may not beat the CPU at int8
            if name in p.delegates:
                assert p.delegates[name].peak_tops["fp16"] > cpu.peak_tops["fp16"], (key, name)
        for name in ACCELERATORS:
            if name in p.delegates:  # an NPU does more int8 work per watt than the CPU
                npu = p.delegates[name]
                assert npu.peak_tops["int8"] / npu.active_w > cpu.peak_tops["int8"] / cpu.active_w
    bw = {k: p.delegates["cpu"].peak_memory_bandwidth_gbs for k, p in profiles.items()}
    assert bw["raspberry-pi-5"] < min(bw[k] for k in PHONES)
    assert max(bw[k] for k in PHONES) < bw["macbook-pro-m4"] < bw["macbook-pro-m4-pro"]
    # the same SoC in a smaller chassis: same compute, no more sustained power
    ultra, plus = profiles["galaxy-s26-ultra"], profiles["galaxy-s26-plus"]
    for name in ultra.delegates:
        assert ultra.delegates[name].peak_tops == plus.delegates[name].peak_tops
        assert plus.delegates[name].active_w <= ultra.delegates[name].active_w


def test_load_by_path_and_unknown_names():
    path = PROFILE_DIR / "raspberry-pi-5.toml"
    assert load_profile(path).name == load_profile("raspberry-pi-5").name
    assert load_profile(str(path)).key == "raspberry-pi-5"
    with pytest.raises(
        EdgeMTPError, match=r"unknown device profile 'pixel-99'; known: .*pixel-10-pro"
    ):
        load_profile("pixel-99")
    with pytest.raises(EdgeMTPError, match="no such device profile file"):
        load_profile("/nonexistent/x.toml")
    with pytest.raises(EdgeMTPError, match="no number at 'delegates.cpu.nope'"):
        load_profile("raspberry-pi-5").source("delegates.cpu.nope")


def test_the_profiles_folder_is_installed_with_the_package():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert "profiles/*.toml" in package_data["edgemtp.devices"]
    assert "edgemtp.devices" in pyproject["tool"]["setuptools"]["packages"]


def test_a_minimal_well_formed_profile_loads(tmp_path):
    path = tmp_path / "mini.toml"
    path.write_text(GOOD)
    p = load_profile(path)
    assert p.key == "mini" and p.battery_wh == 15.0 and p.delegates["cpu"].threads == 4
    assert p.sources["delegates.cpu.peak_tops.int8"][0] == "estimate"
    assert p.delegates["cpu"].peak_tops == {"int8": 2.0}


ONNX_SECTION = """
[delegates.cpu.backends.onnx]
memory_bandwidth_gbs = { value = 20, source = "measured: a run", note = "MatMulNBits, one row" }
verify_bandwidth_gbs = { value = 5, source = "measured: a run", note = "MatMulNBits on 4 rows" }

[delegates.cpu.backends.onnx.peak_tops]
fp32 = { value = 0.5, source = "measured: a run", note = "MatMulNBits on 256 rows, fp32" }
"""


def test_a_backend_section_prices_that_backends_bundles(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text(GOOD + ONNX_SECTION)
    cpu = load_profile(path).delegates["cpu"]
    onnx = cpu.for_backend("onnx")
    assert (onnx.memory_bandwidth_gbs, onnx.verify_bandwidth_gbs) == (20.0, 5.0)
    assert onnx.peak_tops == {"fp32": 0.5} and onnx.dispatch_us == cpu.dispatch_us == 5.0
    assert cpu.for_backend("executorch") is cpu and cpu.for_backend(None) is cpu
    assert cpu.memory_bandwidth_gbs == 40.0 and cpu.verify_bandwidth_gbs is None
    assert load_profile(path).sources["delegates.cpu.backends.onnx.memory_bandwidth_gbs"][0] == (
        "measured: a run"
    )
    for bad, field in (
        ("backends.onnx]", "delegates.cpu.backends.tflite"),
        ("verify_bandwidth_gbs = {", "delegates.cpu.backends.onnx.verify_bw"),
    ):
        text = GOOD + ONNX_SECTION.replace(
            bad, bad.replace("onnx", "tflite").replace("verify_bandwidth_gbs", "verify_bw")
        )
        path.write_text(text)
        with pytest.raises(EdgeMTPError, match=f"field {field}"):
            load_profile(path)


def _swap(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


def _line(key: str, new: str = "") -> str:
    """GOOD with the line `key = ...` replaced by `new` (removed when empty)."""
    lines = GOOD.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith(f"{key} = ")]
    assert len(hits) == 1, key
    lines[hits[0]] = f"{new}\n" if new else ""
    return "".join(lines)


BAD = [
    # (what, text, the field the message must name, words it must contain)
    (
        "missing field",
        _line("dispatch_us"),
        "delegates.cpu.dispatch_us",
        "missing",
    ),
    (
        "number without a source",
        _line("ram_gb", "ram_gb = 8"),
        "ram_gb",
        "bare int",
    ),
    (
        "table without source key",
        _swap('idle_w = { value = 0.6, source = "estimate", note', "idle_w = { value = 0.6, note"),
        "idle_w",
        "no source",
    ),
    (
        "estimate without reasoning",
        _swap('note = "runtime uses the four big cores"', 'note = ""'),
        "delegates.cpu.threads",
        "how it was estimated",
    ),
    (
        "wrong type",
        _swap("memory_bandwidth_gbs = { value = 40,", 'memory_bandwidth_gbs = { value = "40",'),
        "delegates.cpu.memory_bandwidth_gbs",
        "must be a number",
    ),
    (
        "boolean is not a number",
        _swap("active_w = { value = 5,", "active_w = { value = true,"),
        "delegates.cpu.active_w",
        "must be a number",
    ),
    (
        "negative value",
        _swap("int8 = { value = 2.0,", "int8 = { value = -2.0,"),
        "delegates.cpu.peak_tops.int8",
        "positive",
    ),
    (
        "sustained above peak",
        _swap("memory_bandwidth_gbs = { value = 40,", "memory_bandwidth_gbs = { value = 90,"),
        "delegates.cpu.memory_bandwidth_gbs",
        "exceeds the theoretical peak",
    ),
    (
        "unknown dtype",
        _swap("int8 = { value = 2.0,", "int7 = { value = 2.0,"),
        "delegates.cpu.peak_tops.int7",
        "unknown dtype",
    ),
    (
        "unknown delegate",
        GOOD + '\n[delegates.tpu]\nunit = "x"\n',
        "delegates.tpu",
        "unknown delegate",
    ),
    (
        "no cpu delegate",
        GOOD.replace("[delegates.cpu.peak_tops]", "[delegates.gpu.peak_tops]").replace(
            "[delegates.cpu]", "[delegates.gpu]"
        ),
        "delegates.cpu",
        "missing",
    ),
    (
        "bad dispatch unit",
        _swap('dispatch_unit = "kernel"', 'dispatch_unit = "op"'),
        "delegates.cpu.dispatch_unit",
        "must be one of kernel, graph",
    ),
    (
        "fractional threads",
        _swap("threads = { value = 4,", "threads = { value = 4.5,"),
        "delegates.cpu.threads",
        "whole number",
    ),
    (
        "missing battery",
        _line("battery_wh"),
        "battery_wh",
        "mains",
    ),
    (
        "typo at the top level",
        GOOD.replace("ram_gb =", "ram_gib ="),
        "ram_gib",
        "unknown field",
    ),
    (
        "extra key in a number",
        _swap(
            'note = "screen on, low brightness, idle" }',
            'note = "screen on, low brightness, idle", unit = "W" }',
        ),
        "idle_w",
        "unknown key(s) unit",
    ),
    (
        "name not a string",
        _swap('name = "Test phone"', "name = 3"),
        "name",
        "non-empty string",
    ),
]


@pytest.mark.parametrize("what,text,field,words", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_profile_gives_one_line_naming_file_and_field(
    tmp_path, what, text, field, words
):
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(EdgeMTPError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: field {field}:"), message
    assert words in message, message


def test_a_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "syntax.toml"
    path.write_text(GOOD.replace('name = "Test phone"', 'name = "Test phone'))
    with pytest.raises(EdgeMTPError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: malformed device profile (TOML)"), message
    assert "line 1" in message

"""Readers of outside input against malformed files: every fuzz finding stays fixed, random
structures (hypothesis) only ever raise `EdgeMTPError`, and a bounded coverage-guided run
(atheris, `fuzz/run.py`) of each target finds nothing."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import parse_assistant_config, parse_text_config
from edgemtp.model.synth import preset_config
from edgemtp.quantize.gguf_import import GGUFSource
from edgemtp.runtime.bundle import read_manifest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fuzz"))
import targets  # noqa: E402

DATA = Path(__file__).parent / "data" / "fuzz"
FINDINGS = sorted(DATA.glob("*/*"))
SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fuzz_finding_stays_fixed(path):
    start = time.perf_counter()
    targets.check(path.parent.name, path.read_bytes())  # raises anything but EdgeMTPError
    assert time.perf_counter() - start < 5


def test_config_findings_name_the_field():
    with pytest.raises(
        EdgeMTPError, match=r"\(text_config\): malformed .* \(missing 'rope_theta'\)"
    ):
        parse_assistant_config(
            json.loads((DATA / "config" / "rope-without-theta.json").read_text())
        )
    cfg = preset_config("tiny")
    cfg["num_key_value_heads"] = 0
    with pytest.raises(EdgeMTPError, match=r"layer 0 has 0 KV heads .* must be positive"):
        parse_text_config(cfg)
    cfg["num_key_value_heads"] = 1
    cfg["num_hidden_layers"], cfg["layer_types"] = 10**42, None  # was minutes building a list
    with pytest.raises(EdgeMTPError, match=r"num_hidden_layers 10+ is not in 1..1024"):
        parse_text_config(cfg)
    cfg = preset_config("tiny")
    del cfg["rope_parameters"]["full_attention"]["rope_theta"]
    with pytest.raises(EdgeMTPError, match=r"\(missing 'rope_theta'\); fix config.json"):
        parse_text_config(cfg)


def test_safetensors_dtype_of_the_wrong_type_is_named():
    with pytest.raises(EdgeMTPError, match=r"entry 'bf16': unsupported dtype \[4\]"):
        targets.safetensors((DATA / "safetensors" / "dtype-is-a-list.safetensors").read_bytes())


def test_gguf_array_length_past_the_file_is_refused_before_reading(tmp_path):
    finding = DATA / "gguf" / "array-length-2e16.gguf"
    start = time.perf_counter()
    with pytest.raises(EdgeMTPError, match=r"not a readable GGUF file.*array of \d+ items"):
        GGUFSource(finding)
    assert time.perf_counter() - start < 1
    header = struct.pack("<IIQQ", 0x46554747, 3, 10**9, 1)  # a billion tensors in 24 bytes
    (tmp_path / "many.gguf").write_bytes(header + b"\0" * 64)
    with pytest.raises(EdgeMTPError, match=r"1 key-values and 1000000000 tensors declared"):
        GGUFSource(tmp_path / "many.gguf")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@SETTINGS
@given(st.data())
def test_configs_with_random_fields_raise_only_edgemtp_errors(data):
    """A real preset config with random keys replaced, removed or added, at both levels."""
    for parse, preset in ((parse_text_config, "tiny"), (parse_assistant_config, "tiny-assistant")):
        cfg = preset_config(preset)
        section = cfg.get("text_config", cfg) if data.draw(st.booleans()) else cfg
        for key in data.draw(st.lists(st.sampled_from(sorted(section)), max_size=3)):
            if data.draw(st.booleans()):
                section.pop(key, None)
            else:
                section[key] = data.draw(_JSON)
        section.update(data.draw(st.dictionaries(st.text(max_size=6), _JSON, max_size=2)))
        try:
            parse(cfg)
        except EdgeMTPError as err:
            assert "\n" not in str(err)


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), _JSON, max_size=3), st.binary(max_size=64))
def test_safetensors_headers_with_random_entries_raise_only_edgemtp_errors(header, data):
    raw = json.dumps(header).encode()
    targets.check("safetensors", struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("target", list(targets.TARGETS))
def test_bounded_coverage_guided_run_finds_nothing(target, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / "run.py"), target, "--seconds", "10",
         "--work", str(tmp_path), "--out", str(tmp_path / "result.json")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    record = json.loads((tmp_path / "result.json").read_text())["records"][0]
    assert record["executions"] > 100 and record["findings"] == []


SEED_MANIFEST = ROOT / "fuzz" / "seeds" / "manifest.json"


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON value (dict keys and list indexes)."""
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else []
    )
    out = [prefix] if prefix else []
    for key, inner in items:
        out += _paths(inner, (*prefix, key))
    return out


def test_the_manifest_seed_is_in_the_current_schema(tmp_path):
    (tmp_path / "manifest.json").write_bytes(SEED_MANIFEST.read_bytes())
    read_manifest(tmp_path)  # no files beside it: the schema and the names only


@SETTINGS
@given(st.data())
def test_manifests_with_random_fields_raise_only_edgemtp_errors(data):
    """A real bundle's manifest with random fields replaced, removed or added at any depth."""
    manifest = json.loads(SEED_MANIFEST.read_text())
    for path in data.draw(st.lists(st.sampled_from(_paths(manifest)), min_size=1, max_size=3)):
        parent = manifest
        try:
            for key in path[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(_JSON)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed or replaced this path
    try:
        targets.manifest(json.dumps(manifest).encode())
    except EdgeMTPError as err:
        assert "\n" not in str(err)

"""`edgemtp conformance` and the decode engines that replay its vectors.

The vectors come from the trained embedded pair exported to ONNX (real acceptance: rounds that
accept none, some and all drafts), and must regenerate byte for byte. Two engines replay them
without the model: the Python runtime (`runtime.generate.decode` over `StaticBackend`) and the
C++ decode core of the apps (`apps/core`, built here with CMake). A vector with one committed
token changed must fail both.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from edgemtp.cli import main
from edgemtp.model.embedded import ASSISTANT, TARGET
from edgemtp.runtime.conformance import (
    ConformanceMismatch,
    read_vectors,
    replay_vectors,
    vectors_text,
)

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "apps" / "core"
CONTEXT, DEPTH, CHUNK, TOKENS = 256, 3, 32, 48


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conformance") / "bundle"
    assert main(
        [
            "export", "--model", str(TARGET), "--drafter", str(ASSISTANT), "--quant", "q4_0",
            "--backend", "onnx", "--max-context", str(CONTEXT), "--draft-depth", str(DEPTH),
            "--prefill-chunk", str(CHUNK), "--out", str(out),
        ]
    ) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def written(bundle, tmp_path_factory) -> tuple[Path, Path]:
    """vectors.json from two runs of the command on the same bundle."""
    root = tmp_path_factory.mktemp("vectors")
    paths = []
    for run in ("first", "second"):
        out = root / run
        code = main(["conformance", "--bundle", str(bundle), "--out", str(out)])
        assert code == 0
        paths.append(out / "vectors.json")
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def vectors(written) -> dict:
    return read_vectors(written[0])


def _corrupted(vectors: dict) -> tuple[dict, str]:
    """The vectors with one committed token changed (in a round that accepted drafts)."""
    bad = json.loads(json.dumps(vectors))
    vocab = bad["manifest"]["model"]["vocab_size"]
    for c in bad["cases"]:
        for i, r in enumerate(c["rounds"]):
            if r["accepted"] >= 1:
                r["committed"][0] = (r["committed"][0] + 1) % vocab
                return bad, f"case '{c['name']}': rounds[{i}].committed[0]"
    raise AssertionError("no round accepted a draft")


# --- the command -------------------------------------------------------------------------------


def test_vectors_regenerate_byte_for_byte(written, bundle):
    first, second = written
    text = first.read_bytes()
    assert text == second.read_bytes()
    vectors = json.loads(text)
    manifest_sha = hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    assert vectors["bundle"]["manifest_sha256"] == manifest_sha
    assert vectors["format"]["name"] == "edgemtp-conformance"
    assert str(bundle.parent) not in text.decode()  # no absolute paths
    assert vectors_text(vectors).encode() == text  # sorted, stable formatting
    assert [p.name for p in first.parent.iterdir()] == ["vectors.json"]  # no leftovers
    assert not [p for p in first.parent.parent.iterdir() if p.name.startswith(".")]


def test_vectors_cover_every_decision_the_loop_makes(vectors):
    cases = {c["name"]: c for c in vectors["cases"]}
    assert vectors["manifest"]["shapes"]["max_draft"] == DEPTH
    assert {c["depth"] for c in cases.values()} == {0, 1, 2, 3}
    rounds = [(c, r) for c in cases.values() for r in c["rounds"]]
    # Rounds that accept none, some and all of their drafts.
    assert any(r["accepted"] == 0 < r["depth"] for _, r in rounds)
    assert any(0 < r["accepted"] < r["depth"] for _, r in rounds)
    assert any(r["accepted"] == r["depth"] == DEPTH for _, r in rounds)
    # Shallow rounds are left-padded into the deepest verify method.
    assert any(r["verify"]["method"] == f"verify_{DEPTH}" and r["verify"]["pad"] for _, r in rounds)
    # Prefill: one padded chunk, and several chunks.
    short = cases["short-depth0"]["prefill"]["calls"]
    assert [c["method"] for c in short] == ["prefill_final"] and short[0]["pad"] > 0
    multi = [c["method"] for c in cases["multi_chunk-depth0"]["prefill"]["calls"]]
    assert multi == ["prefill_intermediate"] * 2 + ["prefill_final"]
    # The sliding ring wraps: a verified row's slot is no longer its position.
    slots = vectors["manifest"]["cache"]["kinds"]["sliding"]["slots"]
    wrap = cases["ring_wrap-depth3"]["rounds"]
    assert slots < CONTEXT and any(r["position_after"] > slots for r in wrap)
    assert any(
        r["slots"]["sliding"][r["verify"]["pad"] :]
        != list(range(r["position"], r["position"] + r["verify"]["rows"]))
        for r in wrap
    )
    # The depth is capped by the budget and by the context end, which ends generation.
    capped = [(c, r) for c, r in rounds if r["depth"] < c["depth"]]
    assert any(c["stop_reason"] == "length" for c, _ in capped)
    end = cases["context_end-depth3"]
    assert end["stop_reason"] == "context" and end["rounds"][-1]["position_after"] == CONTEXT
    assert any(r["depth"] < 3 for r in end["rounds"])
    # One case stops on a token committed mid-round: later tokens dropped, the cache rolled back.
    (stopped,) = [c for c in cases.values() if c["stop_ids"]]
    assert stopped["stop_reason"] == "stop" and stopped["tokens"][-1] == stopped["stop_ids"][0]
    last = stopped["rounds"][-1]
    assert len(last["committed"]) < last["accepted"] + 1
    assert [t["length"] for t in last["truncates"]] == [
        last["position"] + last["accepted"] + 1,
        last["position_after"],
    ]
    # Method choice is also checked on a bucketed shape set (context buckets).
    assert any(
        row["method"].endswith("_ctx512") for t in vectors["method_choice"] for row in t["verify"]
    )


def test_command_errors_are_one_line(bundle, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    for argv, message in (
        (["--depths", "4"], "verifies at most 3 drafts"),
        (["--tokens", "1"], "--tokens must be >= 2"),
        (["--out", str(tmp_path / "taken")], "holds more than vectors.json"),
    ):
        args = ["conformance", "--bundle", str(bundle), "--out", str(tmp_path / "v"), *argv]
        assert main(args) == 1
        *progress, error = capsys.readouterr().err.strip().splitlines()
        assert error.startswith("edgemtp conformance: error: ") and message in error
        assert all(line.startswith("-- ") for line in progress)  # no traceback
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "v").exists()


# --- the Python runtime replays them -----------------------------------------------------------


def test_python_runtime_replays_the_vectors(vectors):
    checked = replay_vectors(vectors)
    assert checked["cases"] == len(vectors["cases"]) == 17
    assert checked["rounds"] == sum(len(c["rounds"]) for c in vectors["cases"])
    assert checked["method_choices"] > 0


def test_python_replay_fails_on_a_changed_committed_token(vectors):
    bad, where = _corrupted(vectors)
    with pytest.raises(ConformanceMismatch, match="^" + re.escape(where)):
        replay_vectors(bad)


def test_python_replay_fails_on_a_changed_model_output(vectors):
    bad = json.loads(json.dumps(vectors))
    round_ = next(r for r in bad["cases"][0]["rounds"] if r["depth"] == 0)
    round_["target_argmax"][0] += 1  # the engine then feeds a different token next
    with pytest.raises(ConformanceMismatch, match="program call"):
        replay_vectors(bad)


# --- the C++ core replays them -----------------------------------------------------------------


def _core(build: Path, vectors_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(build / "conformance_test"), str(vectors_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cpp_core_passes_its_unit_tests_and_the_vectors(core_build, written):
    configure = ["cmake", "-S", str(CORE), "-B", str(core_build)]
    done = subprocess.run(
        [*configure, f"-DEDGEMTP_CONFORMANCE_VECTORS={written[0]}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    subprocess.run(["cmake", "--build", str(core_build)], check=True, capture_output=True)
    ctest = subprocess.run(
        ["ctest", "--test-dir", str(core_build), "--output-on-failure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ctest.returncode == 0, ctest.stdout + ctest.stderr
    assert re.search(r"Test +#\d+: conformance \.+ +Passed", ctest.stdout), ctest.stdout
    assert "100% tests passed" in ctest.stdout
    direct = _core(core_build, written[0])
    assert direct.returncode == 0, direct.stderr
    assert "17 cases" in direct.stdout and "every decision matches" in direct.stdout


def test_cpp_core_fails_on_a_changed_committed_token(core_build, vectors, tmp_path):
    bad, where = _corrupted(vectors)
    path = tmp_path / "vectors.json"
    path.write_text(vectors_text(bad))
    done = _core(core_build, path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"conformance: FAIL: {where}: expected"), lines


def test_cpp_core_refuses_unreadable_vectors(core_build, tmp_path):
    path = tmp_path / "vectors.json"
    path.write_text('{"format": {"name": "edgemtp-conformance", "version": 1}, "cases": [}')
    done = _core(core_build, path)
    assert done.returncode == 2 and "line 1, column" in done.stderr

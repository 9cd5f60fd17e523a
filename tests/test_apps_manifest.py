"""The apps' manifest parsing (`apps/core`'s `BundleConfig::from_manifest`) against manifests
that `edgemtp export` writes, for every backend.

`manifest_test` (built here with CMake) prints what the C++ core understood from a manifest.json;
each field is compared with the manifest itself and with the Python side (`StaticShapes`' method
choice, the runtime's ring sizes). The manifests: ONNX and Core ML bundles of the tiny preset
exported here, and for ExecuTorch (minutes to lower, too slow for this test) the committed
manifest of a real tiny ExecuTorch bundle, `fuzz/seeds/manifest.json`. That one has no context
buckets (the only backend with them is ExecuTorch cpu), so a copy with buckets and the bucketed
methods an export would add is checked too. Every manifest must also validate against
`runtime/manifest.schema.json`, and the core must refuse what it cannot use in one line.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from edgemtp import __version__
from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes, bucketed
from edgemtp.runtime.bundle import SCHEMA, SCHEMA_VERSION, check_manifest
from edgemtp.runtime.capabilities import SUPPORTED
from edgemtp.runtime.conformance import manifest_mismatches

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "apps" / "core"
EXECUTORCH_SEED = ROOT / "fuzz" / "seeds" / "manifest.json"
SEED_BUCKETS = (32, 64)  # context buckets for the seed's copy: inside (max_draft, max_context)
SHAPE_ARGS = ["--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8"]

Manifest = dict[str, Any]


# --- fixtures ----------------------------------------------------------------------------------


def _export_args(pair: tuple[Path, Path], backend: str, delegate: str, out: Path) -> list[str]:
    target, drafter = pair
    return [
        "export", "--model", str(target), "--drafter", str(drafter), "--backend", backend,
        "--delegate", delegate, *SHAPE_ARGS, "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def core(core_build) -> Path:
    return core_build


@pytest.fixture(scope="module")
def onnx_manifest(tiny_q4_0_pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "bundle"
    assert main(_export_args(tiny_q4_0_pair, "onnx", "cpu", out)) == 0
    return out / "manifest.json"


@pytest.fixture(scope="module")
def coreml_manifest(tiny_coreml_bundle) -> Path:
    return tiny_coreml_bundle / "manifest.json"


@pytest.fixture(scope="module")
def executorch_manifest() -> Path:
    return EXECUTORCH_SEED


@pytest.fixture(scope="module")
def executorch_bucketed_manifest(tmp_path_factory) -> Path:
    seed = json.loads(EXECUTORCH_SEED.read_text())
    # The seed has no buckets; a bucketed seed would make this copy (and this check) moot.
    assert seed["shapes"]["context_buckets"] == [], "the seed has buckets: test it directly"
    path = tmp_path_factory.mktemp("bucketed") / "manifest.json"
    path.write_text(json.dumps(with_context_buckets(seed, SEED_BUCKETS), indent=1))
    return path


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# --- helpers -----------------------------------------------------------------------------------


def with_context_buckets(manifest: Manifest, buckets: tuple[int, ...]) -> Manifest:
    """`manifest` as an ExecuTorch cpu export with `--context-buckets` writes it: the buckets in
    its shapes and, per bucket, each prefill and decode method again under its bucketed name
    (`StaticBundle.methods`: same inputs and outputs, reading only the bucket's slots)."""
    shapes = StaticShapes(**{**manifest["shapes"], "context_buckets": buckets})
    out = copy.deepcopy(manifest)
    out["shapes"]["context_buckets"] = list(shapes.context_buckets)
    decode = ["prefill_intermediate", "prefill_final"]
    decode += [f"verify_{k}" for k in shapes.verify_depths]
    decode += ["draft_step"] if manifest["drafter"] is not None else []
    for bucket in shapes.context_buckets:
        for name in decode:
            for table in ("methods", "method_io"):
                out[table][bucketed(name, bucket)] = copy.deepcopy(manifest[table][name])
    return out


def run_core(build: Path, manifest: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(build / "manifest_test"), str(manifest), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def understood(build: Path, manifest: Path, *queries: str) -> dict[str, Any]:
    """What the core read from `manifest` (and the methods of `queries`, "DEPTH:END")."""
    done = run_core(build, manifest, *queries)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    return json.loads(line)


def refusal(build: Path, manifest: Path) -> str:
    """The core's one-line reason for refusing `manifest`."""
    done = run_core(build, manifest)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout)
    (line,) = done.stderr.splitlines()
    prefix = f"manifest_test: {manifest}: manifest: "
    assert line.startswith(prefix), line
    return line.removeprefix(prefix)


def edited(manifest: Path, tmp_path: Path, change: Callable[[Manifest], object]) -> Path:
    """A copy of `manifest` changed in place by `change`."""
    data = json.loads(manifest.read_text())
    change(data)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data, indent=1))
    return path


# --- what the core reads -----------------------------------------------------------------------


def test_core_reads_the_schema_version_and_backends_that_export_writes(core):
    done = subprocess.run([str(core / "manifest_test"), "--reads"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    reads = json.loads(done.stdout)
    schema = json.loads(SCHEMA.read_text())
    assert (
        reads["schema_version"] == SCHEMA_VERSION == schema["properties"]["schema_version"]["const"]
    )
    assert reads["backends"] == {backend: list(d) for backend, d in SUPPORTED.items()}
    assert sorted(reads["backends"]) == sorted(schema["properties"]["backend"]["enum"])
    delegates = {d for ds in reads["backends"].values() for d in ds}
    assert delegates == set(schema["properties"]["delegate"]["enum"])


def test_bucketed_copy_exercises_every_bucket(core, executorch_bucketed_manifest, validator):
    """The default rounds cross each bucket boundary, so the bucketed methods are checked."""
    manifest = json.loads(executorch_bucketed_manifest.read_text())
    validator.validate(manifest)
    seen = understood(core, executorch_bucketed_manifest)
    assert manifest_mismatches(seen, manifest) == []
    verify = {(r["depth"], r["end"]): r["verify"] for r in seen["rounds"]}
    assert verify[(2, 32)] == "verify_2_ctx32" and verify[(2, 33)] == "verify_2_ctx64"
    assert verify[(1, 64)] == "verify_2_ctx64" and verify[(1, 65)] == "verify_2"
    assert verify[(0, 1)] == "verify_0_ctx32" and verify[(0, 96)] == "verify_0"
    drafts = {r["draft"] for r in seen["rounds"]}
    assert {"draft_step_ctx32", "draft_step_ctx64", "draft_step"} <= drafts
    prefill = {r["end"]: r["prefill"] for r in seen["rounds"]}
    assert prefill[32] == "prefill_final_ctx32" and prefill[33] == "prefill_final_ctx64"
    assert prefill[96] == "prefill_final"


def test_explicit_rounds_match_static_shapes(core, executorch_bucketed_manifest):
    manifest = json.loads(executorch_bucketed_manifest.read_text())
    queries = ["0:1", "1:31", "2:34", "2:64", "2:65", "2:96", "3:40", "2:97", "1:1"]
    seen = understood(core, executorch_bucketed_manifest, *queries)
    assert manifest_mismatches(seen, manifest, queries) == []
    errors = [r["error"] for r in seen["rounds"] if "error" in r]
    assert errors == [
        "a round of 3 drafts: this bundle verifies at most 2",
        "a round of 2 drafts ending at 97 does not fit the context (ends 3..96)",
        "a round of 1 drafts ending at 1 does not fit the context (ends 2..96)",
    ]


# --- what the comparison catches ---------------------------------------------------------------


def test_comparison_fails_on_a_manifest_with_another_draft_depth(core, onnx_manifest, tmp_path):
    """A consistent manifest whose max_draft differs (1 instead of 2, verify_2 renamed
    verify_1): the core accepts it, and comparing what it read with the real manifest fails."""
    original = json.loads(onnx_manifest.read_text())

    def shallower(m: Manifest) -> None:
        m["shapes"].update(max_draft=1, verify_depths=[0, 1])
        for table in ("methods", "method_io"):
            m[table]["verify_1"] = m[table].pop("verify_2")

    seen = understood(core, edited(onnx_manifest, tmp_path, shallower))
    problems = manifest_mismatches(seen, original)
    assert any(p.startswith("max_draft: core 1, manifest/Python 2") for p in problems), problems
    assert any(p.startswith("methods: ") for p in problems)
    assert any(p.startswith("rounds: ") for p in problems)  # no depth-2 rounds
    assert any(p.startswith("round 1:2: ") and "verify_1" in p for p in problems)


def test_core_refuses_a_max_draft_its_methods_cannot_run(core, onnx_manifest, tmp_path):
    path = edited(
        onnx_manifest, tmp_path, lambda m: m["shapes"].update(max_draft=1, verify_depths=[0, 1])
    )
    assert refusal(core, path) == (
        "the program has no method 'verify_1', which the shapes and drafter call for (it has "
        "draft_step, prefill_final, prefill_intermediate, verify_0, verify_2)"
    )


# --- what the core refuses ---------------------------------------------------------------------


def test_core_refuses_a_newer_schema_version_naming_both(core, onnx_manifest, tmp_path, validator):
    path = edited(
        onnx_manifest, tmp_path, lambda m: m.update(schema_version=2, edgemtp_version="9.1.0")
    )
    assert refusal(core, path) == (
        "schema version 2 (written by edgemtp 9.1.0) is newer than this app reads (schema "
        "version 1): update the app, or export the bundle with the edgemtp this app matches"
    )
    manifest = json.loads(path.read_text())
    assert not validator.is_valid(manifest)
    # The Python runtime refuses it the same way: both versions named.
    with pytest.raises(EdgeMTPError, match="schema version 2 .*reads schema version 1"):
        check_manifest(manifest, path)


def _drop(path: list[str]) -> Callable[[Manifest], None]:
    def change(m: Manifest) -> None:
        parent = m
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]

    return change


def _first_layer_attention(m: Manifest) -> None:
    m["model"]["layers"][0]["attention"] = "chunked"


# (change, the core's reason, whether runtime/manifest.schema.json rejects it too)
REFUSALS: dict[str, tuple[Callable[[Manifest], object], str, bool]] = {
    "older schema": (
        lambda m: m.update(schema_version=0),
        f"schema version 0 (written by edgemtp {__version__}) is older than this app reads "
        "(schema version 1): export the bundle again with a current edgemtp",
        True,
    ),
    "no schema version": (_drop(["schema_version"]), "missing schema_version", True),
    "unknown backend": (
        lambda m: m.update(backend="tflite"),
        "unknown backend 'tflite' (this app runs executorch, coreml, onnx)",
        True,
    ),
    "delegate of another backend": (
        lambda m: m.update(delegate="npu"),
        "backend onnx has no delegate 'npu' (it has cpu, htp)",
        False,  # the schema checks each field alone; export.bundle.check_pair checks the pair
    ),
    "no shapes": (_drop(["shapes"]), "missing shapes", True),
    "no chunk": (_drop(["shapes", "chunk"]), "missing shapes.chunk", True),
    "chunk not an integer": (
        lambda m: m["shapes"].update(chunk="8"),
        "shapes.chunk: expected an integer, got a string",
        True,
    ),
    "context bucket past the context": (
        lambda m: m["shapes"].update(context_buckets=[200]),
        "shapes: context bucket 200 must be ascending and lie between the draft depth + 1 and the "
        "max context, exclusive",
        False,
    ),
    "ring smaller than window + drafts": (
        lambda m: m["cache"]["kinds"]["sliding"].update(slots=18, trash_slot=18),
        "cache.kinds.sliding.slots is 18, must be in 19..96 (window 16 + max_draft 2 + 1, up to "
        "max_context)",
        False,
    ),
    "no verify method": (
        _drop(["methods", "verify_2"]),
        "the program has no method 'verify_2'",
        False,
    ),
    "draft_step without a drafter": (
        lambda m: m.update(drafter=None),
        "drafter is null but the program has a draft_step method",
        False,
    ),
    "layer kind without a cache": (
        _first_layer_attention,
        "model.layers[0] has chunked attention but cache.kinds has no 'chunked' cache",
        True,
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_core_refuses_a_manifest_it_cannot_use_in_one_line(
    name, core, onnx_manifest, tmp_path, validator
):
    change, reason, schema_rejects = REFUSALS[name]
    path = edited(onnx_manifest, tmp_path, change)
    assert refusal(core, path).startswith(reason)
    assert validator.is_valid(json.loads(path.read_text())) is not schema_rejects


def test_core_refuses_text_that_is_not_json(core, tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{"schema_version": 1,')
    assert refusal(core, path).startswith("not valid JSON: line 1, column")
    missing = run_core(core, tmp_path / "missing.json")
    assert missing.returncode == 1
    assert missing.stderr == f"manifest_test: {tmp_path / 'missing.json'}: cannot open the file\n"


# --- every backend's export --------------------------------------------------------------------

BACKEND_MANIFESTS = {
    "executorch": ("executorch_manifest", "executorch", "cpu", "model.pte"),
    "executorch-bucketed": ("executorch_bucketed_manifest", "executorch", "cpu", "model.pte"),
    "onnx": ("onnx_manifest", "onnx", "cpu", "onnx"),
    "coreml": ("coreml_manifest", "coreml", "npu", "model.mlpackage"),
}


@pytest.mark.parametrize("name", BACKEND_MANIFESTS)
def test_core_understands_the_manifest_export_writes(name, core, validator, request):
    fixture, backend, delegate, program = BACKEND_MANIFESTS[name]
    path: Path = request.getfixturevalue(fixture)
    manifest = json.loads(path.read_text())
    validator.validate(manifest)  # the schema the apps parse against
    seen = understood(core, path)
    assert manifest_mismatches(seen, manifest) == []
    assert (seen["backend"], seen["delegate"], seen["program"]) == (backend, delegate, program)
    assert seen["has_drafter"] and seen["max_draft"] == 2
    # An export holds exactly the methods the decoder calls: none missing, none extra.
    assert seen["methods"] == seen["required_methods"]
    depths = {r["depth"] for r in seen["rounds"]}
    assert depths == {0, 1, 2} and not any("error" in r for r in seen["rounds"])

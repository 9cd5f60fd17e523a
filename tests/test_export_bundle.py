"""The bundle around the compiled program: host tables, manifest, atomic output, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.export.bundle import write_tables
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_target
from edgemtp.runtime.bundle import open_tables, read_manifest, verify_files
from edgemtp.runtime.capabilities import check_pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundle")
    paths = {
        "target": write_preset("tiny", root / "t", init_std=0.05),
        "drafter": write_preset("tiny-assistant", root / "a", init_std=0.05),
    }
    paths["other"] = root / "o"  # another target: same shapes but a wider sliding window
    shutil.copytree(paths["target"], paths["other"])
    config = json.loads((paths["other"] / "config.json").read_text())
    (paths["other"] / "config.json").write_text(json.dumps(dict(config, sliding_window=32)))
    paths["q4_0"] = root / "q"
    quantize_checkpoint(paths["target"], paths["q4_0"], Settings(scheme="q4_0", ple="int8"))
    paths["fp16"] = root / "f"
    quantize_checkpoint(paths["target"], paths["fp16"], Settings(embeddings="fp16", ple="fp16"))
    return paths


@pytest.mark.parametrize("kind", ["target", "q4_0", "fp16"])
def test_tables_round_trip_as_stored(tiny, tmp_path, kind):
    target = load_target(tiny[kind])
    description = write_tables(target.tables, tmp_path, lambda _: None)
    tables = open_tables(tmp_path, target.cfg, description)
    expected = {"target": ("bf16", "bf16"), "q4_0": ("q4_0", "int8_row"), "fp16": ("f16", "f16")}
    assert (description["token"]["format"], description["ple"]["format"]) == expected[kind]
    ids = torch.tensor([0, 3, 511, 3, 200])
    assert torch.equal(tables.embed(ids), target.tables.embed(ids))
    assert torch.equal(tables.per_layer_inputs(ids), target.tables.per_layer_inputs(ids))
    stored = (tmp_path / description["file"]).stat().st_size
    if kind == "q4_0":  # 18 bytes per 32 token-table values, 1 byte (+ a row scale) per PLE value
        assert stored < 512 * 64 * 18 / 32 + 512 * 160 * 1.1 + 1024


def test_unsupported_pairs_name_the_alternative():
    check_pair("onnx", "htp")
    with pytest.raises(EdgeMTPError, match="--backend coreml has no 'htp'.*executorch or onnx"):
        check_pair("coreml", "htp")
    with pytest.raises(EdgeMTPError, match="--backend onnx has no 'npu'.*executorch or coreml"):
        check_pair("onnx", "npu")


def _export_error(capsys, *argv: object) -> str:
    code = main(["export", *map(str, argv)])
    _, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_drafter_from_another_target(tiny, tmp_path, capsys):
    out = tmp_path / "bundle"
    line = _export_error(
        capsys,
        "--model",
        tiny["other"],
        "--drafter",
        tiny["drafter"],
        "--backend",
        "onnx",
        "--out",
        out,
    )
    assert line.startswith("edgemtp export: error: drafter does not match this target")
    assert "sliding_window: drafter 16 != target 32" in line
    assert not out.exists() and _leftovers(tmp_path) == []


def test_impossible_delegate(tiny, tmp_path, capsys):
    out = tmp_path / "bundle"
    line = _export_error(
        capsys, "--model", tiny["target"], "--backend", "coreml", "--delegate", "htp", "--out", out
    )
    assert "has no 'htp' delegate" in line and "--backend executorch or onnx" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--backend", "onnx", "--context-buckets", "32"), "an ExecuTorch cpu (XNNPACK) option"),
        (("--backend", "executorch", "--context-buckets", "1k"), "give token counts like"),
        (("--backend", "executorch", "--context-buckets", "4096"), "between the draft depth"),
    ],
)
def test_bad_context_buckets(tiny, tmp_path, capsys, flags, expected):
    out = tmp_path / "bundle"
    line = _export_error(capsys, "--model", tiny["target"], *flags, "--out", out)
    assert line.startswith("edgemtp export: error: ") and expected in line
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize(("kernels", "attention"), [("edgemtp", "kernel"), ("xnnpack", "matmul")])
def test_attention_is_a_deprecated_alias_of_kernels(
    tiny, tmp_path, capsys, monkeypatch, kernels, attention
):
    """`--attention kernel|matmul` asks export/ for what `--kernels edgemtp|xnnpack` does, with
    one deprecation line on stderr."""
    import edgemtp.export.bundle

    requests = []

    def export(request, progress):  # the request export/ gets, not lowered
        requests.append(request)
        return {"files": {}, "quantization": {"scheme": "q4_0"}, "methods": {}}

    monkeypatch.setattr(edgemtp.export.bundle, "export", export)
    argv = ["export", "--model", str(tiny["q4_0"]), "--backend", "executorch"]
    argv += ["--out", str(tmp_path / "bundle")]
    assert main([*argv, "--kernels", kernels]) == 0
    assert capsys.readouterr().err == ""
    assert main([*argv, "--attention", attention]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "edgemtp export: --attention is deprecated; use --kernels edgemtp|xnnpack"
    ]
    assert requests[0] == requests[1] and requests[0].kernels == kernels


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--backend", "onnx", "--kernels", "xnnpack"), "--kernels is an ExecuTorch cpu option"),
        (("--backend", "onnx", "--attention", "matmul"), "--kernels is an ExecuTorch cpu option"),
        (("--backend", "executorch", "--kernels", "edgemtp", "--attention", "matmul"),
         "pass only --kernels"),
    ],
)  # fmt: skip
def test_bad_kernels(tiny, tmp_path, capsys, flags, expected):
    out = tmp_path / "bundle"
    line = _export_error(capsys, "--model", tiny["q4_0"], *flags, "--out", out)
    assert line.startswith("edgemtp export: error: ") and expected in line
    assert not out.exists()


def test_missing_qnn_sdk_is_named_before_any_work(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    out = tmp_path / "bundle"
    line = _export_error(
        capsys, "--model", tiny["target"], "--quant", "q4_0", "--backend", "executorch",
        "--delegate", "htp", "--out", out,
    )  # fmt: skip
    assert line == (
        "edgemtp export: error: --delegate htp needs Qualcomm AI Engine Direct (QNN) SDK: "
        "install it and set QNN_SDK_ROOT (or use --delegate cpu)"
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_requantizing_a_quantized_checkpoint_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "bundle"
    line = _export_error(
        capsys, "--model", tiny["q4_0"], "--quant", "w4a16", "--backend", "onnx", "--out", out
    )
    assert "stored as q4_0" in line and "never re-quantized" in line
    assert not out.exists() and _leftovers(tmp_path) == []


def test_no_space_for_the_output(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bundle"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    line = _export_error(capsys, "--model", tiny["target"], "--backend", "onnx", "--out", out)
    assert "not enough space" in line and "GiB free" in line
    assert not out.exists() and _leftovers(tmp_path) == []


def test_core_ml_needs_its_working_space(tiny, tmp_path, capsys, monkeypatch):
    """Core ML writes spilled codes and a function's package beside the bundle: free space for
    the bundle alone is refused, with what it needs."""
    from edgemtp.export.bundle import WORKING_DISK
    from edgemtp.export.memory import linear_elements

    out = tmp_path / "bundle"
    bundle_alone = sum(f.stat().st_size for f in tiny["target"].rglob("*")) // 2
    working = int(WORKING_DISK["coreml"] * linear_elements(tiny["target"], None))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=bundle_alone + 1))
    line = _export_error(capsys, "--model", tiny["target"], "--backend", "coreml", "--out", out)
    assert f"about {(bundle_alone + working) / 2**30:.2f} GiB needed" in line
    assert not out.exists() and _leftovers(tmp_path) == []


def test_existing_output_and_missing_input(tiny, tmp_path, capsys):
    out = tmp_path / "bundle"
    out.mkdir()
    line = _export_error(capsys, "--model", tiny["target"], "--backend", "onnx", "--out", out)
    assert "already exists" in line and "--force" in line
    line = _export_error(capsys, "--model", tmp_path / "nope", "--backend", "onnx", "--out", out)
    assert "does not exist" in line


def test_a_cache_larger_than_this_machine_is_refused_before_allocating(
    tiny, tmp_path, capsys, monkeypatch
):
    import edgemtp.runtime.probes as probes

    monkeypatch.setattr(probes, "physical_memory", lambda: 2**25)
    out = tmp_path / "bundle"
    line = _export_error(
        capsys, "--model", tiny["target"], "--backend", "onnx", "--max-context", "131072",
        "--out", out,
    )  # fmt: skip
    # tiny's KV owners: layer 4 (full: 1 head x 32 dims, a slot per position) and layers 0-3
    # (sliding: 1 x 16, a ring of window 16 + 1); K and V, fp32
    need = 2 * 4 * (131072 * 32 + 4 * 17 * 16)
    assert need > 2**25
    assert line == (
        f"edgemtp export: error: --max-context 131072: the KV cache alone takes "
        f"{need / 2**30:.2f} GiB, more than this machine's 0.03 GiB of memory; use a smaller "
        "--max-context"
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_chunk_larger_than_the_sliding_ring(tiny, tmp_path, capsys):
    line = _export_error(
        capsys,
        "--model",
        tiny["target"],
        "--backend",
        "onnx",
        "--prefill-chunk",
        "64",
        "--draft-depth",
        "2",
        "--out",
        tmp_path / "b",
    )
    assert "exceeds the smallest cache (19 slots" in line


def test_target_only_bundle_builds_no_verify_rounds(tiny, tmp_path):
    out = tmp_path / "ar"
    argv = ["export", "--model", str(tiny["target"]), "--backend", "onnx", "--max-context", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest["shapes"]["max_draft"] == 0
    assert sorted(manifest["methods"]) == ["prefill_final", "prefill_intermediate", "verify_0"]
    assert manifest["cache"]["kinds"]["sliding"]["slots"] == 17  # window 16 + 1: no draft rows


def test_manifest_from_another_schema(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(EdgeMTPError, match="schema version 99"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(EdgeMTPError, match="corrupt manifest"):
        read_manifest(tmp_path)


# --- a whole export through the command line, run back through the bundle ------------------


@pytest.fixture(scope="module")
def quantized_pair(tiny, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    quantize_checkpoint(tiny["drafter"], root / "a", Settings(scheme="q4_0"))
    return tiny["q4_0"], root / "a"


@pytest.fixture(scope="module")
def onnx_bundle(quantized_pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "bundle"
    target, drafter = quantized_pair
    code = main(
        [
            "export", "--model", str(target), "--drafter", str(drafter), "--backend", "onnx",
            "--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8", "--out", str(out),
            "--activations", "fp32",  # the reference's numerics: its tokens are the oracle
        ]
    )  # fmt: skip
    assert code == 0
    return out


def test_bundle_manifest_describes_what_was_written(onnx_bundle, tmp_path):
    manifest = read_manifest(onnx_bundle)
    verify_files(onnx_bundle, manifest)
    assert set(manifest["files"]) == {
        p.relative_to(onnx_bundle).as_posix()
        for p in onnx_bundle.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert manifest["quantization"]["scheme"] == "q4_0"
    assert manifest["shapes"] == {
        "max_context": 96,
        "max_draft": 2,
        "chunk": 8,
        "context_buckets": [],
        "verify_depths": [0, 2],
    }
    roles = [layer["kv"] for layer in manifest["model"]["layers"]]
    assert roles == ["owns"] * 3 + ["stores"] * 2 + ["reuses"] * 5  # tiny: 5 KV-shared layers
    assert manifest["cache"]["kinds"]["sliding"] == {"slots": 19, "ring": True, "trash_slot": 19}
    assert sorted(manifest["methods"]) == sorted(
        ["prefill_intermediate", "prefill_final", "verify_0", "verify_2", "draft_step"]
    )
    verify = manifest["methods"]["verify_2"]
    assert [o["shape"] for o in verify["outputs"]] == [[3, 512], [3, 64]]
    assert manifest["numerics"]["weights"]
    copy = shutil.copytree(onnx_bundle, tmp_path / "copy")
    with (copy / "tables.safetensors").open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 1]))  # flip one bit of the last byte
    with pytest.raises(EdgeMTPError, match="'tables.safetensors' does not match its SHA-256"):
        verify_files(copy, manifest)


def _sha(text: str) -> dict[str, object]:
    return {"bytes": 1, "sha256": text}


BAD_MANIFESTS = {
    "newer schema": (
        lambda m: m.update(schema_version=2, edgemtp_version="9.1.0"),
        r"schema version 2 \(written by edgemtp 9.1.0\); this edgemtp \S+ reads schema version "
        r"1: use edgemtp 9.1.0 or newer to run it",
    ),
    "older schema": (
        lambda m: m.update(schema_version=0),
        r"schema version 0 .* reads schema version 1: export the bundle again",
    ),
    "program outside the bundle": (
        lambda m: m.update(program="../model.pte"),
        r"field 'program': '../model.pte' is not a relative path inside the bundle",
    ),
    "absolute file": (
        lambda m: m["files"].update({"/etc/passwd": _sha("0" * 64)}),
        r"field 'files': '/etc/passwd' is not a relative path inside the bundle",
    ),
    "file up and out": (
        lambda m: m["files"].update({"onnx/../../x": _sha("0" * 64)}),
        r"'onnx/../../x' is not a relative path inside the bundle",
    ),
    "not a hash": (
        lambda m: m["files"]["config.json"].update(sha256="abc"),
        r"field 'files/config.json/sha256': 'abc' is not a SHA-256 in 64 lowercase hex digits",
    ),
    "wrong type": (
        lambda m: m["shapes"].update(max_context="96"),
        r"field 'shapes/max_context': '96' is not of type 'integer'",
    ),
    "unknown table format": (
        lambda m: m["tables"]["token"].update(format="q5_k"),
        r"field 'tables/token/format': 'q5_k' is not one of",
    ),
    "missing field": (lambda m: m.pop("files"), r"'files' is a required property"),
    "unknown field": (lambda m: m.update(extra=1), r"\('extra' was unexpected\)"),
    "unlisted program": (
        lambda m: m.update(program="model.pte"),
        r"the manifest names 'model.pte' but lists no such file",
    ),
    "layers cut short": (
        lambda m: m["model"]["layers"].pop(),
        r"describes 9 layers of a 10-layer model",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_manifest_out_of_schema_is_refused_in_one_line(onnx_bundle, tmp_path, case):
    mutate, expected = BAD_MANIFESTS[case]
    manifest = json.loads((onnx_bundle / "manifest.json").read_text())
    mutate(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EdgeMTPError, match=expected) as err:
        read_manifest(tmp_path)
    assert "\n" not in str(err.value) and str(err.value).endswith(
        "or newer to run it" if case == "newer schema" else "export the bundle again"
    )


def test_generate_on_a_manifest_that_leaves_the_bundle(onnx_bundle, tmp_path, capsys):
    copy = shutil.copytree(onnx_bundle, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(dict(manifest, program="/etc")))
    code = main(["generate", "--bundle", str(copy), "--prompt-ids", "1 2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        f"edgemtp generate: error: {copy / 'manifest.json'}: manifest field 'program': '/etc' is "
        "not a relative path inside the bundle (no leading '/', no '..' part, no backslash); "
        "export the bundle again"
    ]


def test_coreml_bundle_manifest_is_in_the_schema(tiny_coreml_bundle):
    """Export checks every manifest before writing it (the ExecuTorch and ONNX tests export
    theirs); a Core ML bundle cannot run here, so its manifest is checked on its own."""
    import jsonschema

    from edgemtp.runtime.bundle import SCHEMA

    out = tiny_coreml_bundle
    manifest = read_manifest(out)
    jsonschema.validate(manifest, json.loads(SCHEMA.read_text()))
    verify_files(out, manifest)
    assert (manifest["backend"], manifest["delegate"], manifest["quantization"]["scheme"]) == (
        "coreml",
        "npu",
        "q4_0",
    )
    assert sorted(manifest["method_io"]) == sorted(manifest["methods"])


def test_bundle_generates_the_reference_tokens(quantized_pair, tmp_path_factory):
    from oracle_drafts import greedy

    from edgemtp.quantize.load import load_drafter
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.generate import generate

    out = tmp_path_factory.mktemp("onnx2") / "bundle"
    target_path, drafter_path = quantized_pair
    assert main(
        [
            "export", "--model", str(target_path), "--drafter", str(drafter_path),
            "--backend", "onnx", "--max-context", "96", "--draft-depth", "2",
            "--prefill-chunk", "8", "--out", str(out), "--activations", "fp32",
        ]
    ) == 0  # fmt: skip
    manifest = read_manifest(out)
    target = load_target(target_path)
    tables = open_tables(out, target.cfg, manifest["tables"])
    driver = StaticBackend(_runner(out, manifest), tables, target.cfg)
    drafter = load_drafter(drafter_path, target.cfg)
    prompt = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    for depth in (0, 2):
        ref = generate(target, prompt, 40, drafter=drafter, mtp_depth=depth, prefill_chunk=8)
        assert greedy(driver, prompt, 40, depth).tokens == ref.tokens


def test_same_inputs_same_bytes(quantized_pair, onnx_bundle, tmp_path):
    """Another process (another string-hash seed) exports the very same bytes."""
    target, drafter = quantized_pair
    out = tmp_path / "again"
    cmd = [
        sys.executable, "-m", "edgemtp.cli", "export", "--model", str(target), "--drafter",
        str(drafter), "--backend", "onnx", "--max-context", "96", "--draft-depth", "2",
        "--prefill-chunk", "8", "--out", str(out), "--activations", "fp32",  # as onnx_bundle
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "7"})
    first = {p.relative_to(onnx_bundle): p.read_bytes() for p in onnx_bundle.rglob("*.*")}
    second = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.*")}
    assert first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_export_leaves_no_bundle(quantized_pair, tmp_path, sig):
    target, drafter = quantized_pair
    out = tmp_path / "bundle"
    cmd = [
        sys.executable, "-m", "edgemtp.cli", "export", "--model", str(target), "--drafter",
        str(drafter), "--backend", "onnx", "--max-context", "96", "--draft-depth", "2",
        "--prefill-chunk", "8", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until the backend is writing into the temporary folder
        if "trace prefill_final" in line:
            break
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
    assert not out.exists()
    if sig != signal.SIGKILL:  # cleaned up; a SIGKILL can only leave a hidden ".bundle.*.partial"
        assert _leftovers(tmp_path) == []
    else:
        assert all(name.endswith(".partial") or name.startswith(".edgemtp-quantize")
                   for name in _leftovers(tmp_path))  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_quantize_leaves_nothing(e2b_pair, tmp_path, sig):
    source = e2b_pair[0].parent / "t"  # the float checkpoint: its token table takes a second
    out = tmp_path / "quantized"
    cmd = [
        sys.executable, "-m", "edgemtp.cli", "quantize", "--model", str(source), "--scheme",
        "q4_0", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # "[1/1] model.safetensors: ...": the writing has begun
    assert "model.safetensors" in first, first + proc.stderr.read()
    proc.send_signal(sig)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    assert rest.strip().splitlines()[-1] == "edgemtp quantize: interrupted"
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def e2b_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The E2B preset shrunk 10x (the real 262144-token vocabulary stays), Q4_0."""
    root = tmp_path_factory.mktemp("e2b")
    write_preset("e2b", root / "t", scale=0.1, init_std=0.05)
    write_preset("e2b-assistant", root / "a", scale=0.1, init_std=0.05)
    for name in ("t", "a"):
        quantize_checkpoint(root / name, root / f"q{name}", Settings(scheme="q4_0"))
    return root / "qt", root / "qa"


def _runner(bundle: Path, manifest: dict):
    from edgemtp.model.static import StaticShapes

    shapes = StaticShapes(**manifest["shapes"])
    if manifest["backend"] == "onnx":
        from edgemtp.runtime.runners.onnx import OnnxRunner

        return OnnxRunner(bundle / manifest["program"], shapes)
    from edgemtp.runtime.runners.executorch import ExecuTorchRunner

    return ExecuTorchRunner(bundle / manifest["program"], shapes)


@pytest.mark.parametrize("backend", ["onnx"])
def test_scaled_e2b_bundle_generates_the_reference_tokens(e2b_pair, tmp_path, backend):
    from oracle_drafts import greedy

    from edgemtp.quantize.load import load_drafter
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.generate import generate

    target_path, drafter_path = e2b_pair
    out = tmp_path / "bundle"
    assert main(
        [
            "export", "--model", str(target_path), "--drafter", str(drafter_path),
            "--backend", backend, "--max-context", "128", "--draft-depth", "2",
            "--prefill-chunk", "16", "--out", str(out), "--activations", "fp32",
        ]
    ) == 0  # fmt: skip
    manifest = read_manifest(out)
    target = load_target(target_path)
    drafter = load_drafter(drafter_path, target.cfg)
    tables = open_tables(out, target.cfg, manifest["tables"])
    driver = StaticBackend(_runner(out, manifest), tables, target.cfg)
    prompt = torch.randint(3, 50000, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    for depth in (0, 2):  # 37 prompt tokens: two intermediate chunks and a padded final one
        ref = generate(target, prompt, 32, drafter=drafter, mtp_depth=depth, prefill_chunk=16)
        got = greedy(driver, prompt, 32, depth)
        assert got.tokens == ref.tokens
        assert got.drafted == ref.metrics()["drafted"]

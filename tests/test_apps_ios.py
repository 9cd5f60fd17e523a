"""The iOS sample app (`apps/ios`) as far as a host without Apple's SDKs can check it.

Nothing here builds the app: that needs Xcode, the iOS SDK and Swift, none of which exist on
Linux. What is checked instead:

- the Swift package's layout: every path Package.swift and App/project.yml name exists, the
  core target's `src`/`include` links resolve to `apps/core`'s own files, each target imports
  only modules it depends on, and every header the Objective-C++ code includes exists;
- the Core ML runner takes its functions and their input/output names from the manifest at run
  time: its platform-free half (`CoreMLPlan.cpp`) is compiled here with g++ and run on a Core ML
  manifest that `edgemtp export` writes (method_io from `export/coreml.py` itself), against the
  Python side's delegate -> compute-units mapping; and no source spells a method or I/O name;
- that half's reading of Core ML outputs (fp16/fp32/fp64/int32, padded strides) against numpy,
  and its int32 narrowing;
- the bench result's folder and file name are those `runtime/bench_report.py` gives and keeps,
  and `edgemtp bench collect` accepts an app result with the app's battery object;
- the app's power and heat states reach that object as the core's battery extras (Swift ->
  `EMBatteryReading.extra` -> `BatteryReading.extra`), with no rewriting of the result JSON;
- Info.plist parses and turns on file sharing.

Where `swiftc` or Apple's SDK (`xcrun`) exists, the Swift sources are parsed and the
Objective-C++ compiled for syntax; elsewhere those tests skip and say so.
"""

from __future__ import annotations

import inspect
import json
import os
import plistlib
import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgemtp.cli import main
from edgemtp.export import coreml
from edgemtp.export.lowered import Lowered
from edgemtp.runtime import bench_report
from edgemtp.runtime.capabilities import coreml_compute_units

ROOT = Path(__file__).resolve().parents[1]
IOS = ROOT / "apps" / "ios"
CORE = ROOT / "apps" / "core"
RUNNER = IOS / "Sources" / "EdgeMTPCoreML"
SAMPLE = IOS / "Sources" / "EdgeMTPSample"
METHOD_NAME = re.compile(r"^(prefill_intermediate|prefill_final|verify_\d+|draft_step)(_ctx\d+)?$")
STRICT = ["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wshadow", "-Wconversion"]


def _sources(*suffixes: str) -> list[Path]:
    """The package's own sources (the core's are reached through links and not walked)."""
    return sorted(
        p
        for p in (IOS / "Sources").rglob("*")
        if p.suffix in suffixes and "EdgeMTPCore" not in p.relative_to(IOS / "Sources").parts[:1]
    ) + sorted((IOS / "App").rglob("*.swift"))


def _package() -> str:
    return (IOS / "Package.swift").read_text()


# --- the package's layout ----------------------------------------------------------------------


def test_package_swift_names_paths_that_exist_and_links_into_the_core():
    text = _package()
    tools = re.match(r"// swift-tools-version:\s*(\d+)\.(\d+)", text)
    assert tools and (int(tools[1]), int(tools[2])) >= (5, 9)
    assert ".iOS(.v18)" in text and ".macOS(.v15)" in text
    assert "cxxLanguageStandard: .cxx17" in text  # the core is C++17 (apps/core/CMakeLists.txt)

    targets = dict(re.findall(r'name: "([^"]+)",(?:[^)]|\n)*?path: "([^"]+)"', text))
    assert set(targets) == {"EdgeMTPCore", "EdgeMTPCoreML", "EdgeMTPSample", "edgemtp-ios-check"}
    for name, path in targets.items():
        assert (IOS / path).is_dir(), f"target {name}: {path} is missing"
    on_disk = {p.name for p in (IOS / "Sources").iterdir() if p.is_dir()}
    assert on_disk == {Path(p).name for p in targets.values()}  # no folder outside a target

    core = IOS / targets["EdgeMTPCore"]
    for link, real in (("src", CORE / "src"), ("include", CORE / "include")):
        assert (core / link).is_symlink(), f"{link} must be a link, not a copy that goes stale"
        assert (core / link).resolve() == real.resolve()
        assert not Path(os.readlink(core / link)).is_absolute()  # works in any checkout
    assert sorted(p.name for p in (core / "src").glob("*.cpp")) == sorted(
        p.name for p in (CORE / "src").glob("*.cpp")
    )
    assert (core / "include" / "edgemtp" / "engine.h").is_file()
    assert (core / "include" / "edgemtp" / "bench.h").is_file()
    for public in re.findall(r'publicHeadersPath: "([^"]+)"', text):
        assert any((IOS / p / public).is_dir() for p in targets.values())
    # SwiftPM makes the Objective-C module's map from the header named after the target.
    assert (RUNNER / "include" / "EdgeMTPCoreML.h").is_file()


def test_each_target_imports_only_what_it_depends_on():
    text = _package()
    system = {"Dispatch", "Foundation", "Observation", "Synchronization", "SwiftUI", "UIKit",
              "UniformTypeIdentifiers"}  # fmt: skip
    depends = {
        "EdgeMTPSample": {"EdgeMTPCoreML"},
        "edgemtp-ios-check": {"EdgeMTPCoreML"},
        "App": {"EdgeMTPSample"},  # App/project.yml's package product
    }
    for target in ("EdgeMTPSample", "edgemtp-ios-check"):
        declared = re.search(rf'name: "{target}",\s*dependencies: \[([^\]]*)\]', text)
        assert declared, target
        assert set(re.findall(r'"([^"]+)"', declared[1])) == depends[target]
    folders = {"EdgeMTPSample": SAMPLE, "edgemtp-ios-check": IOS / "Sources" / "edgemtp-ios-check",
               "App": IOS / "App"}  # fmt: skip
    for target, folder in folders.items():
        for swift in folder.rglob("*.swift"):
            imports = set(re.findall(r"^import (\w+)", swift.read_text(), re.M))
            assert imports <= system | depends[target], f"{swift.name} imports {imports}"


def test_objective_c_includes_resolve():
    search = [RUNNER, RUNNER / "include", CORE / "include"]
    for source in RUNNER.rglob("*"):
        if source.suffix not in (".h", ".mm", ".cpp"):
            continue
        for header in re.findall(r'^#\s*(?:import|include) "([^"]+)"', source.read_text(), re.M):
            assert any((d / header).is_file() for d in search), f"{source.name}: {header}"
    # The module Swift imports must stay plain Objective-C: no C++ in its public headers.
    for header in (RUNNER / "include").glob("*.h"):
        code = re.sub(r"//[^\n]*", "", header.read_text())
        includes = re.findall(r'^#\s*(?:import|include) [<"]([^">]+)[">]', code, re.M)
        assert set(includes) <= {"Foundation/Foundation.h", "EMEngine.h", "EMBench.h"}, header
        assert "std::" not in code and "namespace" not in code, header


def test_xcodegen_project_uses_the_package_and_a_file_sharing_info_plist():
    spec = yaml.safe_load((IOS / "App" / "project.yml").read_text())
    package = spec["packages"]["EdgeMTP"]["path"]
    assert (IOS / "App" / package / "Package.swift").resolve() == (IOS / "Package.swift").resolve()
    (app,) = spec["targets"].values()
    assert app["type"] == "application" and app["platform"] == "iOS"
    assert spec["options"]["deploymentTarget"]["iOS"] == "18.0"
    products = re.findall(r'\.library\(name: "([^"]+)"', _package())
    assert [d["product"] for d in app["dependencies"]] == ["EdgeMTPSample"]
    assert set(products) >= {"EdgeMTPSample"}
    for source in app["sources"]:
        assert (IOS / "App" / source).is_dir()
    settings = app["settings"]["base"]
    assert settings["GENERATE_INFOPLIST_FILE"] is False
    info = plistlib.loads((IOS / "App" / settings["INFOPLIST_FILE"]).read_bytes())
    assert info["UIFileSharingEnabled"] is True  # Documents shows in Finder's Files tab
    assert info["LSSupportsOpeningDocumentsInPlace"] is True  # ... and in the Files app
    assert info["CFBundleIdentifier"] == "$(PRODUCT_BUNDLE_IDENTIFIER)"
    assert info["CFBundleExecutable"] == "$(EXECUTABLE_NAME)"
    assert "UILaunchScreen" in info


# --- names come from the manifest --------------------------------------------------------------


def _string_literals(path: Path) -> list[str]:
    text = path.read_text()
    text = re.sub(r"//[^\n]*", "", text)  # comments may name methods
    return re.findall(r'"((?:[^"\\\n]|\\.)*)"', text)


def test_no_source_spells_a_method_or_io_name(coreml_manifest):
    manifest = json.loads(coreml_manifest.read_text())
    io_names = set()
    for spec in manifest["method_io"].values():
        io_names |= set(spec["inputs"]) | set(spec["outputs"])
    for spec in manifest["methods"].values():  # the logical names too
        io_names |= {t["name"] for t in spec["inputs"] + spec["outputs"]}
    for source in _sources(".swift", ".mm", ".h", ".cpp"):
        for literal in _string_literals(source):
            assert not METHOD_NAME.match(literal), f"{source.name} hard-codes method {literal!r}"
            assert literal not in io_names, f"{source.name} hard-codes I/O name {literal!r}"
    # The one name fragment the runner knows: export/coreml.py's calling protocol, where a
    # function that writes the cache returns new_pos_<kind> (the core's engine reads it too).
    literals = {s: _string_literals(s) for s in _sources(".mm", ".cpp")}
    assert [s.name for s, found in literals.items() if "new_pos_" in found] == ["CoreMLRunner.mm"]
    plan = (RUNNER / "CoreMLPlan.cpp").read_text()
    assert '"method_io"' in plan and "BundleConfig::from_manifest" in plan


@pytest.fixture(scope="module")
def coreml_manifest(tiny_q4_0_pair, tmp_path_factory, monkeypatch_module) -> Path:
    """A Core ML manifest as `edgemtp export --backend coreml --delegate npu` writes it. The
    lowering is replaced by its manifest-facing part (the function I/O `export/coreml.py`
    declares, its compute units, a package folder), so that no coremltools conversion runs: a
    manifest in seconds instead of a minute."""
    from edgemtp.export import bundle

    def lower(static, delegate, out_dir, progress, **_):
        package = Path(out_dir) / coreml.PACKAGE
        package.mkdir()
        (package / "Manifest.json").write_text("{}")
        return Lowered(
            files=[f"{coreml.PACKAGE}/Manifest.json"], program=coreml.PACKAGE,
            numerics={"note": "not converted (test)"},
            details={"compute_units": coreml_compute_units(delegate)},
            method_io=coreml.declared_io(static),
        )  # fmt: skip

    monkeypatch_module.setattr(bundle, "_lowerer", lambda backend: lower)
    target, drafter = tiny_q4_0_pair
    out = tmp_path_factory.mktemp("ios-coreml") / "bundle"
    assert main([
        "export", "--model", str(target), "--drafter", str(drafter), "--backend", "coreml",
        "--delegate", "npu", "--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8",
        "--out", str(out),
    ]) == 0  # fmt: skip
    return out / "manifest.json"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _compile(source: Path, out: Path, flags: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["g++", "-std=c++17", *flags, f"-I{CORE / 'include'}", f"-I{RUNNER}", "-c", str(source),
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plan_check(tmp_path_factory) -> Path:
    """apps/ios/HostCheck/coreml_plan_check.cpp with the runner's platform-free half, built with
    the core's warnings and -Wshadow -Wconversion as errors, linked with the core's sources it
    needs (all of them if the few it needs today stop being enough)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++: the Core ML runner's platform-free half cannot be built here")
    build = tmp_path_factory.mktemp("ios-plan-check")
    own = [RUNNER / "CoreMLPlan.cpp", IOS / "HostCheck" / "coreml_plan_check.cpp"]
    core = [CORE / "src" / f"{n}.cpp" for n in ("json", "decode", "sampling")]

    def compiled(sources: list[Path], flags: list[str]) -> list[Path]:
        objects = [build / f"{s.stem}.o" for s in sources]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda s, o: _compile(s, o, flags), sources, objects))
        for source, result in zip(sources, results, strict=True):
            assert result.returncode == 0, f"{source.name}:\n{result.stderr}"
        return objects

    def linked(objects: list[Path]) -> subprocess.CompletedProcess:
        command = ["g++", *map(str, objects), "-o", str(build / "coreml_plan_check")]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    objects = compiled(own, STRICT) + compiled(core, [])
    link = linked(objects)
    if link.returncode != 0:  # the core's sources grew new dependencies: take them all
        link = linked(objects + compiled(sorted(set((CORE / "src").glob("*.cpp")) - set(core)), []))
    assert link.returncode == 0, link.stderr
    return build / "coreml_plan_check"


def _run(binary: Path, *args: str) -> tuple[int, str]:
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.strip()


def test_the_runner_reads_functions_and_io_from_the_manifest(plan_check, coreml_manifest, tmp_path):
    manifest = json.loads(coreml_manifest.read_text())
    assert manifest["backend_details"]["compute_units"] == "CPU_AND_NE"
    for delegate in ("npu", "metal", "cpu"):  # a package runs on any: units are chosen at load
        path = tmp_path / f"{delegate}.json"
        path.write_text(json.dumps({**manifest, "delegate": delegate}))
        rc, out = _run(plan_check, "plan", str(path))
        assert rc == 0, out
        plan = json.loads(out)
        assert plan["program"] == manifest["program"] == coreml.PACKAGE
        assert plan["delegate"] == delegate
        # The Python runtime's mapping (runtime/capabilities.py's coreml_compute_units).
        assert plan["compute_units"] == coreml_compute_units(delegate)
        assert plan["functions"] == manifest["method_io"]  # names and order, as written
        assert set(plan["functions"]) == set(manifest["methods"])


def test_the_runner_feeds_the_engine_inputs_in_each_function_order(plan_check, coreml_manifest):
    path = coreml_manifest
    method_io = json.loads(path.read_text())["method_io"]
    rng = random.Random(0)
    for method, io in method_io.items():
        given = list(io["inputs"])
        rng.shuffle(given)
        rc, out = _run(plan_check, "bind", str(path), method, *given)
        assert rc == 0 and json.loads(out) == io["inputs"], (method, out)
        missing = given[1:]
        rc, out = _run(plan_check, "bind", str(path), method, *missing)
        assert rc == 1 and out == f"error: {method}: the engine gave no input '{given[0]}'"
        rc, out = _run(plan_check, "bind", str(path), method, *given, "surplus")
        assert rc == 1 and "'surplus', which the function does not declare" in out
    rc, out = _run(plan_check, "bind", str(path), "verify_3", "embeds")
    assert rc == 1 and out.startswith("error: model.mlpackage has no function 'verify_3'")


def test_the_runner_refuses_what_it_cannot_run(plan_check, coreml_manifest, tmp_path):
    manifest = json.loads(coreml_manifest.read_text())

    def refusal(**changes) -> str:
        path = tmp_path / "manifest.json"
        path.write_text(json.dumps({**manifest, **changes}))
        rc, out = _run(plan_check, "plan", str(path))
        assert rc == 1, out
        return out

    assert "no delegate 'htp'" in refusal(delegate="htp")  # the core's own refusal, first
    assert "this is a onnx bundle" in refusal(backend="onnx", delegate="cpu")
    assert "must name the package inside the bundle" in refusal(program="../model.mlpackage")
    assert "method_io" in refusal(method_io={})
    broken = {**manifest["method_io"], "draft_step": {"inputs": ["token_embed", 3], "outputs": []}}
    assert "method_io.draft_step.inputs must hold names" in refusal(method_io=broken)


# --- outputs and inputs as Core ML hands them over ---------------------------------------------


@pytest.mark.parametrize("dtype", ["f16", "f32", "f64", "i32"])
def test_outputs_of_any_layout_read_as_the_engine_tensor(plan_check, tmp_path, dtype):
    np_dtype = {"f16": np.float16, "f32": np.float32, "f64": np.float64, "i32": np.int32}[dtype]
    if dtype == "f16":  # every finite half, subnormals and signed zeros included
        bits = np.arange(1 << 16, dtype=np.uint16)
        values = bits.view(np.float16)[np.isfinite(bits.view(np.float16))]
        values = values[: (values.size // 64) * 64].reshape(-1, 8, 8)
    else:
        values = (np.random.default_rng(1).standard_normal((3, 5, 7)) * 1000).astype(np_dtype)
    # Padded rows and planes, as the Neural Engine lays arrays out.
    padded = np.zeros((values.shape[0], values.shape[1] + 1, values.shape[2] + 3), np_dtype)
    padded[:, : values.shape[1], : values.shape[2]] = values
    strides = [s // padded.itemsize for s in padded.strides]
    path = tmp_path / "buffer.bin"
    padded.tofile(path)
    shape = ",".join(map(str, values.shape))
    rc, out = _run(plan_check, "read", dtype, shape, ",".join(map(str, strides)), str(path))
    assert rc == 0, out
    tensor = json.loads(out)
    assert tensor["shape"] == list(values.shape)
    assert tensor["dtype"] == ("int64" if dtype == "i32" else "float32")
    expected = values.astype(np.int64 if dtype == "i32" else np.float32).ravel()
    assert np.array_equal(np.array(tensor["values"], dtype=expected.dtype), expected)

    too_far = [strides[0] * 2, *strides[1:]]  # a layout that leaves the buffer
    rc, out = _run(plan_check, "read", dtype, shape, ",".join(map(str, too_far)), str(path))
    assert rc == 1 and "does not fit its buffer" in out


def test_int64_inputs_narrow_to_int32_or_are_refused(plan_check):
    rc, out = _run(plan_check, "narrow", "0", "-1", str(2**31 - 1), str(-(2**31)))
    assert rc == 0 and json.loads(out) == [0, -1, 2**31 - 1, -(2**31)]
    rc, out = _run(plan_check, "narrow", "5", str(2**31))
    assert rc == 1 and f"holds {2**31}, beyond the package's int32" in out


# --- bench results -----------------------------------------------------------------------------


def test_bench_results_are_named_and_placed_as_bench_collect_expects(tmp_path, capsys):
    swift = (SAMPLE / "Bench" / "BenchResultFile.swift").read_text()
    python = inspect.getsource(bench_report._result_name)
    (pattern,) = re.findall(r're\.sub\(r"([^"]+)", "-"', python)
    # The same characters become one "-", the stamp drops ':' and '-', a host is "host".
    assert f'#/{pattern}/#, with: "-")' in swift
    assert 'replacing(":", with: "").replacing("-", with: "")' in swift
    assert (
        '?? "host"' in swift
        and '+ ".json"' in swift
        and '"\\(bundle)-\\(machine)-\\(stamp)"' in swift
    )
    assert 'URL.documentsDirectory.appending(path: "bench"' in swift

    # An app result (runs, no summary), with the app's battery object, in Documents/bench/ under
    # the name the app gives it: bench collect must take it, keep the name and the battery.
    doc = {
        "schema": "edgemtp-bench/1",
        "created": "2026-12-01T16:31:46Z",
        "command": "edgemtp-ios-sample bench --pp 16 --tg 8 --mtp 0 --repeat 1 (coreml/npu)",
        "machine": {"platform": "ios", "device": "iPhone18,1", "cpu": "iPhone18,1", "cores": 6,
                    "memory_gib": 11.9, "os": "iOS 26.1.0", "threads": 1,
                    "libraries": {"coreml": "26.1.0", "edgemtp-ios-sample": "0.1.0"}},
        "bundle": {"path": "/var/mobile/Containers/Data/Application/X/Documents/gemma e2b",
                   "name": "gemma e2b", "sha256": "0" * 64, "bytes": 1, "backend": "coreml",
                   "delegate": "npu", "quantization": "q4_0", "max_context": 96, "max_draft": 2},
        "plan": {"pp": [16], "tg": [8], "depths": [0], "repeat": 1, "tg_prompt": 8,
                 "sampling": "greedy"},
        "runs": [
            {"test": "tg8", "depth": 0, "round": 0, "warmup": False, "prompt_tokens": 8,
             "error": None, "tokens": list(range(8)), "generated_tokens": 8, "ttft_s": 0.05,
             "prefill_tok_s": 160.0, "decode_tok_s": 30.0, "rounds": [[0, 0]] * 7,
             "decode_seconds_by_phase": {"target": 0.2}, "valid": None,
             "battery": {"source": "UIDevice.batteryLevel", "unit": "percent", "start": 80.0,
                         "end": 80.0, "battery_state_start": "unplugged",
                         "battery_state_end": "unplugged", "thermal_state_start": "nominal",
                         "thermal_state_end": "fair", "low_power_mode_start": "false",
                         "low_power_mode_end": "false"}},
        ],
    }  # fmt: skip
    name = bench_report._result_name(doc)
    assert name == "gemma-e2b-iPhone18-1-20261201T163146Z.json"
    documents = tmp_path / "Documents"
    (documents / "bench").mkdir(parents=True)
    (documents / "bench" / name).write_text(json.dumps(doc))
    out = tmp_path / "report"
    assert main(["bench", "collect", "--from", str(documents / "bench"), "--out", str(out)]) == 0
    collected = json.loads((out / "results" / name).read_text())
    assert collected["runs"][0]["battery"] == doc["runs"][0]["battery"]
    assert collected["machine"]["platform"] == "ios"
    assert "iPhone18,1" in capsys.readouterr().out


def test_bench_conditions_go_through_the_cores_battery_extras():
    """The app's battery reading carries the charging state, thermal state and Low Power Mode as
    string extras that the core writes as "<key>_start"/"<key>_end"; nothing rewrites the JSON."""
    recorder = (SAMPLE / "Bench" / "BenchConditionsRecorder.swift").read_text()
    service = (SAMPLE / "Engine" / "EngineService.swift").read_text()
    header = (RUNNER / "include" / "EMBench.h").read_text()
    bridge = (RUNNER / "EMBench.mm").read_text()

    # The Swift passes the three states, as strings, on each reading.
    (extras,) = re.findall(r"extra: \[(.*?)\]\)", recorder, re.S)
    assert dict(re.findall(r'"(\w+)": ([^,\n]+),', extras)) == {
        "battery_state": "now.batteryState.rawValue",
        "thermal_state": "now.thermalState.rawValue",
        "low_power_mode": "String(now.isLowPowerModeEnabled)",
    }
    assert 'EMBatteryReading(\n            source: "UIDevice.batteryLevel"' in recorder
    assert "batteryBefore: { recorder.reading() }" in service
    assert "batteryAfter: { recorder.reading() }" in service
    assert "return try engine.runBench(" in service
    assert "JSONSerialization" not in recorder + service
    for swift in _sources(".swift"):
        assert "annotate" not in swift.read_text(), swift

    # The Objective-C++ takes `extra` and maps it, sorted by key, into BatteryReading.extra.
    assert (
        "unit:(NSString *)unit\n"
        "                         extra:(NSDictionary<NSString *, NSString *> *)extra"
        " NS_DESIGNATED_INITIALIZER;" in header
    )
    assert (
        "@property(nonatomic, readonly, copy) NSDictionary<NSString *, NSString *> *extra;"
        in header
    )
    assert "_extra = [extra copy];" in bridge
    assert (
        "for (NSString* key in [r.extra.allKeys sortedArrayUsingSelector:@selector(compare:)]) {\n"
        "    out.extra.emplace_back(em_std(key), em_std(r.extra[key]));\n"
        "  }\n"
        "  return out;" in bridge
    )

    # The core has the field and writes it as the README and the collect test above show.
    core_header = (CORE / "include" / "edgemtp" / "bench.h").read_text()
    core = (CORE / "src" / "bench.cpp").read_text()
    assert "std::vector<std::pair<std::string, std::string>> extra;" in core_header
    assert 'battery[key + "_start"] = utf8(value);' in core
    assert 'battery[key + "_end"] = utf8(value);' in core
    readme = (IOS / "README.md").read_text()
    for key in ("battery_state", "thermal_state", "low_power_mode"):
        assert f'"{key}_start": "' in readme and f'"{key}_end": "' in readme


# --- Apple toolchains, where they exist --------------------------------------------------------


def test_swift_sources_parse():
    swiftc = shutil.which("swiftc")
    if swiftc is None:
        pytest.skip(
            "no swiftc here (no Swift toolchain on this host): the Swift sources were not parsed"
        )
    for source in _sources(".swift"):
        done = subprocess.run([swiftc, "-parse", str(source)], capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name}:\n{done.stderr}"


def test_objective_c_runner_compiles_against_an_apple_sdk():
    if shutil.which("xcrun") is None:
        pytest.skip(
            "no Apple SDK here (xcrun, Xcode): CoreMLRunner.mm and the EMEngine wrapper were not "
            "compiled; only their platform-free half (CoreMLPlan.cpp) was"
        )
    sdk = subprocess.run(
        ["xcrun", "--sdk", "iphoneos", "--show-sdk-path"], capture_output=True, text=True
    )
    assert sdk.returncode == 0, sdk.stderr
    for source in sorted(RUNNER.glob("*.mm")):
        done = subprocess.run(
            ["xcrun", "--sdk", "iphoneos", "clang++", "-fsyntax-only", "-fobjc-arc", "-std=c++17",
             "-target", "arm64-apple-ios18.0", "-isysroot", sdk.stdout.strip(), f"-I{RUNNER}",
             f"-I{RUNNER / 'include'}", f"-I{CORE / 'include'}", str(source)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, f"{source.name}:\n{done.stderr}"

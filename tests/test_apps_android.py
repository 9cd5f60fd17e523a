"""The Android sample app (apps/android), as far as a machine without the Android SDK checks it.

- The JNI bridge (app/src/main/cpp/edgemtp_jni.cpp) compiles with the host g++ against the JDK's
  jni.h and the core's headers, with the warnings the core builds with, as errors.
- The app's native build (app/src/main/cpp/CMakeLists.txt) configured on the host against the
  executorch wheel instead of an ExecuTorch source build: libedgemtp_jni.so links with no
  undefined symbol, exports the bridge, and loading it registers edgemtp's kernels with
  ExecuTorch (so kernel bundles run in the app).
- Every Kotlin `external fun` of NativeEngine has its `Java_...` export (JNI name mangling) with
  parameter and return types that fit, and every export has its `external fun`; every Kotlin
  method the bridge looks up (GetMethodID name and JNI signature) exists in the Kotlin sources
  with that signature, as does every class it finds.
- The app writes benchmark results where `edgemtp bench collect --adb` pulls them
  (runtime/bench_report.py's ANDROID_RESULTS), named as the report names them.
- The pins: the ExecuTorch the native build compiles is the exporter's wheel's release, the
  Gradle wrapper files are Gradle 9.4.1's, and the native build adds apps/core.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANDROID = ROOT / "apps" / "android"
APP = ANDROID / "app"
JNI_SOURCE = APP / "src" / "main" / "cpp" / "edgemtp_jni.cpp"
KOTLIN_ROOT = APP / "src" / "main" / "java"
NATIVE_ENGINE = "dev.edgemtp.sample.engine.NativeEngine"
# Read, not imported: importing edgemtp.runtime loads torch, seconds this test need not spend.
BENCH_REPORT = ROOT / "runtime" / "bench_report.py"

# Gradle 9.4.1's wrapper, as gradle.org/release-checksums and the distribution publish them.
GRADLE_VERSION = "9.4.1"
WRAPPER_JAR_SHA256 = "55243ef57851f12b070ad14f7f5bb8302daceeebc5bce5ece5fa6edb23e1145c"
GRADLEW_SHA256 = "aed171fb114f82e6eaea4970a245a200e0582a7dcc8ec0891ca41b6e4a62b754"
# gradlew.bat with LF line endings (git stores it so; it is checked out with CRLF)
GRADLEW_BAT_SHA256 = "9ca26d733ada3a45f27b2151288f54e75c9f95b287d1f82ef942ec5cc2d4f006"


# --- Kotlin sources ---------------------------------------------------------------------------


def _blank_literals(code: str) -> str:
    """`code` with comments and the text of string and char literals blanked (same length),
    so that brackets inside them do not count; string templates stay code."""
    out = list(code)
    i, n = 0, len(code)
    stack: list[str] = []  # open contexts: '"', '"""' (strings) and '{' (a template's code)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        in_string = bool(stack) and stack[-1] != "{"
        if in_string:
            quote = stack[-1]
            if code.startswith(quote, i):
                stack.pop()
                i += len(quote)
            elif code[i] == "\\" and quote == '"':
                blank(i, i + 2)
                i += 2
            elif code.startswith("${", i):
                stack.append("{")
                i += 2
            else:
                blank(i, i + 1)
                i += 1
            continue
        if code.startswith("//", i):
            end = code.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif code.startswith("/*", i):
            end = code.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank(i, end)
            i = end
        elif code.startswith('"""', i) or code[i] == '"':
            quote = '"""' if code.startswith('"""', i) else '"'
            stack.append(quote)
            i += len(quote)
        elif code[i] == "'":
            end = code.index("'", i + 2 if code[i + 1] == "\\" else i + 1)
            blank(i + 1, end)
            i = end + 1
        elif code[i] == "{" and stack:
            stack.append("{")
            i += 1
        elif code[i] == "}" and stack and stack[-1] == "{":
            stack.pop()
            i += 1
        else:
            i += 1
    return "".join(out)


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """Index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced {opening}{closing} at {start}")


def _top_level(body: str) -> str:
    """`body` with everything nested in braces blanked: only its own declarations remain."""
    out, depth = list(body), 0
    for i, c in enumerate(body):
        if c == "}":
            depth -= 1
        if depth > 0 and c != "\n":
            out[i] = " "
        if c == "{":
            depth += 1
    return "".join(out)


def _split_params(params: str) -> list[tuple[str, str]]:
    """`a: Int, val b: Array<String> = x` -> [("a", "Int"), ("b", "Array<String>")]."""
    parts, depth, current = [], 0, ""
    for c in params:
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
    parts.append(current)
    out = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        declaration = part.split("=")[0]
        name, kind = declaration.split(":", 1)
        out.append((name.split()[-1], kind.strip()))
    return out


@dataclass
class KotlinClass:
    fq_name: str
    package: str
    imports: dict[str, str]
    constructor: list[tuple[str, str]] | None = None  # None: no primary constructor
    properties: dict[str, str] = field(default_factory=dict)  # name -> type
    functions: list[tuple[str, list[tuple[str, str]], str, bool]] = field(default_factory=list)
    constants: dict[str, str] = field(default_factory=dict)  # const val NAME = value


def _parse_kotlin(root: Path) -> dict[str, KotlinClass]:
    classes: dict[str, KotlinClass] = {}
    for path in sorted(root.rglob("*.kt")):
        raw = path.read_text()
        code = _blank_literals(raw)
        package = re.search(r"^package\s+([\w.]+)", code, re.M).group(1)
        imports = {
            m.group(1).rsplit(".", 1)[-1]: m.group(1)
            for m in re.finditer(r"^import\s+([\w.]+)", code, re.M)
        }
        for m in re.finditer(r"\b(?:class|interface|object)\s+(\w+)", _top_level(code)):
            cls = KotlinClass(f"{package}.{m.group(1)}", package, imports)
            i = m.end()
            header = re.match(
                r"\s*(?:private\s+|internal\s+|public\s+)?(?:constructor\s*)?\(", code[i:]
            )
            if header:
                start = i + header.end() - 1
                end = _closing(code, start, "(", ")")
                cls.constructor = _split_params(code[start + 1 : end])
                for param in re.finditer(
                    r"\b(?:val|var)\s+(\w+)\s*:\s*([^,=\n]+)", code[start + 1 : end]
                ):
                    cls.properties[param.group(1)] = param.group(2).strip()
                i = end + 1
            rest = code[i:]
            line = rest.split("\n", 1)[0]
            if "{" in line:
                start = i + line.index("{")
                body = code[start + 1 : _closing(code, start, "{", "}")]
                flat = _top_level(body)
                for prop in re.finditer(
                    r"\b(const\s+)?(?:val|var)\s+(\w+)\s*(?::\s*([\w<>?,. ]+?))?\s*(=|\n|get\b)",
                    flat,
                ):
                    if prop.group(3):
                        cls.properties[prop.group(2)] = prop.group(3).strip()
                for fun in re.finditer(r"\b(external\s+)?fun\s+(?:<[^>]*>\s*)?(\w+)\s*\(", flat):
                    open_at = fun.end() - 1
                    close_at = _closing(flat, open_at, "(", ")")
                    returns = re.match(
                        r"\s*:\s*([\w<>?,. ]+?)\s*(?:=|\{|\n|$)", flat[close_at + 1 :]
                    )
                    cls.functions.append(
                        (
                            fun.group(2),
                            _split_params(flat[open_at + 1 : close_at]),
                            returns.group(1).strip() if returns else "Unit",
                            bool(fun.group(1)),
                        )
                    )
                for const in re.finditer(r"\bconst\s+val\s+(\w+)\s*=\s*(\S+)", body):
                    cls.constants[const.group(1)] = raw[
                        start + 1 + const.start(2) : start + 1 + const.end(2)
                    ]
            classes[cls.fq_name] = cls
    return classes


PRIMITIVES = {
    "Int": "I",
    "Long": "J",
    "Boolean": "Z",
    "Double": "D",
    "Float": "F",
    "Short": "S",
    "Byte": "B",
    "Char": "C",
    "Unit": "V",
}
BOXED = {
    "Int": "java/lang/Integer",
    "Long": "java/lang/Long",
    "Boolean": "java/lang/Boolean",
    "Double": "java/lang/Double",
    "Float": "java/lang/Float",
}
ARRAYS = {
    "IntArray": "[I",
    "LongArray": "[J",
    "DoubleArray": "[D",
    "FloatArray": "[F",
    "ByteArray": "[B",
    "BooleanArray": "[Z",
    "ShortArray": "[S",
    "CharArray": "[C",
}


def _descriptor(
    kind: str, owner: KotlinClass, classes: dict[str, KotlinClass], boxed: bool = False
) -> str:
    """The JVM type descriptor of Kotlin type `kind` written in `owner`'s file."""
    kind = kind.strip()
    nullable = kind.endswith("?")
    kind = kind.rstrip("?").strip()
    if kind in PRIMITIVES and not (nullable or boxed):
        return PRIMITIVES[kind]
    if kind in BOXED:
        return f"L{BOXED[kind]};"
    if kind in ARRAYS:
        return ARRAYS[kind]
    if kind.startswith("Array<"):
        return "[" + _descriptor(kind[6:-1], owner, classes, boxed=True)
    if kind in ("String", "Any"):
        return {"String": "Ljava/lang/String;", "Any": "Ljava/lang/Object;"}[kind]
    fq = owner.imports.get(kind) or next(
        (
            name
            for name in classes
            if name.endswith("." + kind) and classes[name].package == owner.package
        ),
        None,
    )
    assert fq, f"{owner.fq_name}: cannot resolve the type {kind}"
    return "L" + fq.replace(".", "/") + ";"


def _getter(name: str) -> str:
    if re.match(r"is[A-Z]", name):
        return name
    return "get" + name[0].upper() + name[1:]


def _jvm_methods(cls: KotlinClass, classes: dict[str, KotlinClass]) -> set[tuple[str, str]]:
    """(name, descriptor) of every method the class declares, constructors and getters included."""
    methods = set()
    if cls.constructor is not None:
        args = "".join(_descriptor(k, cls, classes) for _, k in cls.constructor)
        methods.add(("<init>", f"({args})V"))
    for name, kind in cls.properties.items():
        methods.add((_getter(name), "()" + _descriptor(kind, cls, classes)))
    for name, params, returns, _ in cls.functions:
        args = "".join(_descriptor(k, cls, classes) for _, k in params)
        methods.add((name, f"({args}){_descriptor(returns, cls, classes)}"))
    return methods


@pytest.fixture(scope="module")
def kotlin() -> dict[str, KotlinClass]:
    return _parse_kotlin(KOTLIN_ROOT)


# --- the C++ bridge ---------------------------------------------------------------------------


def _mangle(name: str) -> str:
    """JNI's short-name mangling of a class or method name."""
    out = []
    for c in name:
        if c.isascii() and c.isalnum():
            out.append(c)
        else:
            out.append(
                {"/": "_", ".": "_", "_": "_1", ";": "_2", "[": "_3"}.get(c) or f"_0{ord(c):04x}"
            )
    return "".join(out)


C_TYPES = {
    "I": "jint",
    "J": "jlong",
    "Z": "jboolean",
    "D": "jdouble",
    "F": "jfloat",
    "S": "jshort",
    "B": "jbyte",
    "C": "jchar",
    "V": "void",
    "Ljava/lang/String;": "jstring",
}
C_TYPES.update(
    {desc: "j" + kind[0].lower() + kind[1:] for kind, desc in ARRAYS.items()}
)  # [I: jintArray


def _c_type(descriptor: str) -> str:
    return C_TYPES.get(descriptor) or ("jobjectArray" if descriptor.startswith("[") else "jobject")


def _jni_exports(source: str) -> dict[str, tuple[str, list[str]]]:
    """Java_* function name -> (return type, parameter types) as the C++ declares them."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", "", source, flags=re.S)
    exports = {}
    for m in re.finditer(r"JNIEXPORT\s+(\w+)\s+JNICALL\s+(Java_\w+)\s*\(([^)]*)\)", code):
        params = []
        for param in m.group(3).split(","):
            tokens = param.replace("*", " * ").split()
            params.append(
                " ".join(tokens[:-1]) if len(tokens) > 1 and tokens[-1] != "*" else " ".join(tokens)
            )
        exports[m.group(2)] = (m.group(1), params)
    return exports


def _method_lookups(source: str) -> list[tuple[str, str, str]]:
    """(class, method, signature) of every entry of the bridge's kMethods table."""
    table = source[source.index("const MethodRef kMethods[]") :]
    table = table[: table.index("};")]
    lookups = []
    for m in re.finditer(
        r'\{\s*"([\w/$]+)",\s*"([^"]+)",\s*((?:"[^"]*"\s*)+),\s*&g\.\w+\s*\}', table
    ):
        lookups.append((m.group(1), m.group(2), "".join(re.findall(r'"([^"]*)"', m.group(3)))))
    return lookups


def _jdk_include() -> Path | None:
    homes = [Path(os.environ["JAVA_HOME"])] if os.environ.get("JAVA_HOME") else []
    if javac := shutil.which("javac"):
        homes.append(Path(javac).resolve().parents[1])
    homes += sorted(Path("/usr/lib/jvm").glob("*")) if Path("/usr/lib/jvm").is_dir() else []
    return next((h / "include" for h in homes if (h / "include" / "jni.h").is_file()), None)


@pytest.fixture(scope="module")
def jni_object(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(a) edgemtp_jni.cpp compiled as the app builds it, warnings as errors."""
    compiler = shutil.which("g++")
    include = _jdk_include()
    if compiler is None or include is None:
        pytest.skip("needs g++ and a JDK's include/jni.h")
    out = tmp_path_factory.mktemp("jni") / "edgemtp_jni.o"
    command = [
        compiler,
        "-std=c++17",
        "-Wall",
        "-Wextra",
        "-Wpedantic",
        "-Werror",
        "-c",
        str(JNI_SOURCE),
        "-o",
        str(out),
        f"-I{include}",
        f"-I{include / 'linux'}",
        f"-I{ROOT / 'apps' / 'core' / 'include'}",
        f"-I{ROOT / 'apps' / 'core' / 'executorch'}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"edgemtp_jni.cpp does not compile:\n{proc.stderr[-4000:]}"
    return out


def test_jni_bridge_compiles_and_exports_what_kotlin_declares(jni_object: Path, kotlin) -> None:
    if shutil.which("nm") is None:
        pytest.skip("needs nm")
    symbols = subprocess.run(
        ["nm", "-g", "--defined-only", str(jni_object)], capture_output=True, text=True, check=True
    ).stdout.split()
    exported = {s for s in symbols if s.startswith("Java_") or s == "JNI_OnLoad"}
    engine = kotlin[NATIVE_ENGINE]
    owner = _mangle(NATIVE_ENGINE.replace(".", "/"))
    expected = {
        f"Java_{owner}_{_mangle(name)}" for name, _, _, external in engine.functions if external
    }
    assert exported == expected | {"JNI_OnLoad"}


@pytest.fixture(scope="module")
def native_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The app's CMakeLists.txt built on the host, linked to the executorch wheel."""
    import executorch

    package = Path(next(iter(executorch.__path__)))
    include = _jdk_include()
    if include is None or shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.skip("needs cmake, g++ and a JDK's include/jni.h")
    if not (package / "lib" / "cmake" / "executorch").is_dir():
        pytest.skip("the executorch wheel has no CMake package here")
    build = tmp_path_factory.mktemp("jni-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = subprocess.run(
        ["cmake", "-S", str(JNI_SOURCE.parent), "-B", str(build), *generator,
         f"-DEDGEMTP_EXECUTORCH_VERSION={version('executorch')}",
         f"-DEDGEMTP_EXECUTORCH_PACKAGE_DIR={package}", f"-DEDGEMTP_JNI_INCLUDE={include}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    done = subprocess.run(["cmake", "--build", str(build), "--target", "edgemtp_jni", "-j2"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return build / "libedgemtp_jni.so"


def test_native_library_runs_executorch_with_edgemtps_kernels(native_library: Path) -> None:
    undefined = subprocess.run(["ldd", "-r", str(native_library)], capture_output=True, text=True)
    assert undefined.returncode == 0
    assert "undefined symbol" not in undefined.stdout + undefined.stderr
    exported = subprocess.run(["nm", "-D", "--defined-only", str(native_library)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "Java_dev_edgemtp_sample_engine_NativeEngine_nativeOpenExecuTorch" in exported
    # Loaded into a process running ExecuTorch, the library adds edgemtp's operators to the
    # runtime's registry (what a `--kernels edgemtp` program needs).
    probe = (
        "import ctypes, sys\n"
        "from executorch.extension.pybindings import portable_lib as et\n"
        "before = set(et._get_operator_names())\n"
        "ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
        "print(' '.join(sorted(set(et._get_operator_names()) - before)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(native_library)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    added = set(done.stdout.split())
    assert {"edgemtp::q4_0_linear.out", "edgemtp::cache_attention.out",
            "edgemtp::rms_norm.out"} <= added, added  # fmt: skip


# --- (b) the bridge and the Kotlin sources agree -------------------------------------------------


def test_every_external_fun_has_a_matching_jni_function(kotlin) -> None:
    source = JNI_SOURCE.read_text()
    exports = _jni_exports(source)
    engine = kotlin[NATIVE_ENGINE]
    externals = [(n, p, r) for n, p, r, external in engine.functions if external]
    assert externals, "NativeEngine declares no external fun"
    names = [n for n, _, _ in externals]
    assert len(names) == len(set(names)), "overloaded natives need JNI's long names: avoid them"
    owner = _mangle(NATIVE_ENGINE.replace(".", "/"))
    for name, params, returns in externals:
        symbol = f"Java_{owner}_{_mangle(name)}"
        assert symbol in exports, f"external fun {name} has no {symbol} in {JNI_SOURCE.name}"
        c_return, c_params = exports[symbol]
        assert c_params[:2] == ["JNIEnv *", "jobject"], (
            f"{symbol}: an instance method takes (JNIEnv*, jobject)"
        )
        wanted = [_c_type(_descriptor(k, engine, kotlin)) for _, k in params]
        assert c_params[2:] == wanted, (
            f"{symbol}: parameters {c_params[2:]}, Kotlin declares {wanted}"
        )
        assert c_return == _c_type(_descriptor(returns, engine, kotlin)), (
            f"{symbol}: returns {c_return}"
        )
    stray = set(exports) - {f"Java_{owner}_{_mangle(n)}" for n in names}
    assert not stray, f"JNI functions without an external fun: {sorted(stray)}"


def test_every_method_the_bridge_calls_exists_in_kotlin(kotlin) -> None:
    lookups = _method_lookups(JNI_SOURCE.read_text())
    ours = [entry for entry in lookups if entry[0].startswith("dev/edgemtp/")]
    assert len(ours) >= 20, f"found only {len(ours)} lookups: has the kMethods table changed shape?"
    for class_name, method, signature in ours:
        fq = class_name.replace("/", ".")
        assert fq in kotlin, f"the bridge looks up {class_name}, which no Kotlin file declares"
        available = _jvm_methods(kotlin[fq], kotlin)
        same_name = sorted(m for m in available if m[0] == method)
        assert (method, signature) in available, (
            f"{fq} has no {method}{signature}; Kotlin declares {same_name}"
        )


def test_every_class_the_bridge_finds_exists_in_kotlin(kotlin) -> None:
    source = JNI_SOURCE.read_text()
    table = source[source.index("const ClassRef kClasses[]") :]
    names = re.findall(r'\{\s*"([\w/$]+)"', table[: table.index("};")])
    assert names
    for name in names:
        if name.startswith("dev/edgemtp/"):
            assert name.replace("/", ".") in kotlin, (
                f"the bridge finds {name}, which no Kotlin file declares"
            )


def test_tensor_dtype_codes_agree(kotlin) -> None:
    source = JNI_SOURCE.read_text()
    codes = dict(re.findall(r"constexpr jint kJava(\w+) = (\d+);", source))
    tensor = kotlin["dev.edgemtp.sample.runner.NativeTensor"]
    assert codes == {"Float32": tensor.constants["FLOAT32"], "Int64": tensor.constants["INT64"]}


# --- (c) benchmark results land where `edgemtp bench collect --adb` looks -------------------------


def _bench_report() -> tuple[str, dict[str, str]]:
    """bench_report.py's ANDROID_RESULTS and the source of each of its functions."""
    source = BENCH_REPORT.read_text()
    tree = ast.parse(source)
    results = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", None) == "ANDROID_RESULTS"
    )
    functions = {
        node.name: ast.get_source_segment(source, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }
    return results, functions


def test_bench_results_go_where_collect_pulls_them() -> None:
    gradle = (APP / "build.gradle.kts").read_text()
    application_id = re.search(r'applicationId\s*=\s*"([\w.]+)"', gradle).group(1)
    results = (KOTLIN_ROOT / "dev" / "edgemtp" / "sample" / "bench" / "BenchResults.kt").read_text()
    folder = re.search(r'const val DIR = "(\w+)"', results).group(1)
    assert "getExternalFilesDir(DIR)" in results
    android_results, functions = _bench_report()
    # getExternalFilesDir(X) is /sdcard/Android/data/<application id>/files/X on the device.
    assert android_results == f"/sdcard/Android/data/{application_id}/files/{folder}"
    assert "remote: str = ANDROID_RESULTS" in functions["collect"]


def test_bench_result_file_names_match_the_report() -> None:
    results = (KOTLIN_ROOT / "dev" / "edgemtp" / "sample" / "bench" / "BenchResults.kt").read_text()
    _, functions = _bench_report()
    python = functions["_result_name"]
    assert re.search(r're\.sub\(r"([^"]+)"', python).group(1) == re.search(
        r'Regex\("([^"]+)"\)', results
    ).group(1)
    # The same fields in the same order, the same stamp and the same fallback for a host.
    assert "f\"{doc['bundle']['name']}-{where}-{stamp}\"" in python
    assert '"$bundleName-$where-$stamp"' in results
    stamp = '.replace(":", "").replace("-", "")'
    assert f'doc["created"]{stamp}' in python and f"createdUtc{stamp}" in results
    assert 'or "host"' in python and 'ifEmpty { "host" }' in results
    assert '+ ".json"' in python and '+ ".json"' in results
    assert 'rglob("*.json")' in functions["collect"]
    # A partly written file must not look like a result to collect.
    assert re.search(r'File\(dir, "\$name\.partial"\)', results)


# --- the pins -------------------------------------------------------------------------------------


def test_executorch_built_in_is_the_exporters_wheel() -> None:
    catalog = tomllib.loads((ANDROID / "gradle" / "libs.versions.toml").read_text())
    assert catalog["versions"]["executorch"] == version("executorch")
    # Gradle hands that version to the native build, which fetches that tag; no ExecuTorch AAR
    # (whose Java Module cannot share the methods' memory arenas) is on the classpath.
    gradle = (APP / "build.gradle.kts").read_text()
    assert "-DEDGEMTP_EXECUTORCH_VERSION=${libs.versions.executorch.get()}" in gradle
    native_build = (JNI_SOURCE.parent / "CMakeLists.txt").read_text()
    assert "GIT_TAG v${EDGEMTP_EXECUTORCH_VERSION}" in native_build
    assert "org.pytorch" not in (ANDROID / "gradle" / "libs.versions.toml").read_text()
    # The ONNX Runtime AAR may trail the wheel (the README says which and why); never lead it.
    aar = tuple(int(x) for x in catalog["versions"]["onnxruntime"].split("."))
    wheel = version("onnxruntime")
    assert aar <= tuple(int(x) for x in wheel.split(".")[:3])
    assert wheel in (ANDROID / "README.md").read_text()


def test_gradle_wrapper_is_gradle_9_4_1() -> None:
    wrapper = ANDROID / "gradle" / "wrapper"
    assert (
        hashlib.sha256((wrapper / "gradle-wrapper.jar").read_bytes()).hexdigest()
        == WRAPPER_JAR_SHA256
    )
    assert hashlib.sha256((ANDROID / "gradlew").read_bytes()).hexdigest() == GRADLEW_SHA256
    bat = (ANDROID / "gradlew.bat").read_bytes().replace(b"\r\n", b"\n")
    assert hashlib.sha256(bat).hexdigest() == GRADLEW_BAT_SHA256
    assert os.access(ANDROID / "gradlew", os.X_OK)
    properties = (wrapper / "gradle-wrapper.properties").read_text()
    assert f"gradle-{GRADLE_VERSION}-bin.zip" in properties
    assert re.search(r"^distributionSha256Sum=[0-9a-f]{64}$", properties, re.M)


def test_native_build_adds_the_core() -> None:
    cmake = (APP / "src" / "main" / "cpp" / "CMakeLists.txt").read_text()
    relative = re.search(
        r"set\(EDGEMTP_CORE_DIR \$\{CMAKE_CURRENT_SOURCE_DIR\}/([\w./]+)\)", cmake
    ).group(1)
    assert "add_subdirectory(${EDGEMTP_CORE_DIR}" in cmake
    core = (JNI_SOURCE.parent / relative).resolve()
    assert core == ROOT / "apps" / "core"
    assert "project(edgemtp_core" in (core / "CMakeLists.txt").read_text()
    assert re.search(r"add_library\(edgemtp_jni SHARED edgemtp_jni\.cpp\)", cmake)
    assert (
        'System.loadLibrary("edgemtp_jni")'
        in (KOTLIN_ROOT / "dev" / "edgemtp" / "sample" / "engine" / "NativeEngine.kt").read_text()
    )

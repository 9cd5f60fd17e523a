"""The Q4_0 linear's arithmetic (`runtime/kernels/q4_0.h`) in every variant, against llama.cpp's
numerics in numpy over gguf's Q4_0 bytes: the aarch64 ones cross-compiled (Debian's
`g++-aarch64-linux-gnu`) and run under user-mode qemu (`qemu-user`), the x86 ones built here.

One static binary per target (`tests/native/q4_0_check.cpp`) runs the variant it is asked for,
or the one it picks from the CPU's features: under `qemu-aarch64 -cpu max` (dotprod and i8mm),
`-cpu cortex-a76` (dotprod) and `-cpu cortex-a53` (plain Armv8.0 NEON) the run-time choice is
checked too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_kernels import CASES as ATTENTION_CASES
from test_kernels import Case as AttentionCase
from test_kernels import LinearCase, numpy_attention, numpy_q4_0_linear

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "native" / "q4_0_check.cpp"
INCLUDE = ROOT / "runtime" / "kernels"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
MISSING = "the aarch64 cross compiler or qemu-user is not installed (apt-get install " \
    "g++-aarch64-linux-gnu qemu-user)"  # fmt: skip

CASES = {
    "decode": LinearCase(1, 256, 70, 21),  # one row, outputs off every tile
    "verify": LinearCase(4, 384, 33, 22),  # the kernel's full group of rows
    "verify_2": LinearCase(3, 2048, 17, 23),  # a group of 3, 64 blocks a row
    "prompt": LinearCase(7, 96, 40, 24),  # 4 + 3 rows; 3 blocks (a quad's tail on x86)
}


def case_file(case: LinearCase, path: Path) -> np.ndarray:
    """Writes the program's input for `case`; returns the numpy oracle's product."""
    x, codes, scales = case.inputs()  # GGML's code bytes, float16 scales
    _, raw = case.ggml()
    with path.open("wb") as f:
        f.write(np.array([case.rows, case.n_in, case.n_out], dtype="<i8").tobytes())
        f.write(x.numpy().astype("<f4").tobytes())
        f.write(codes.numpy().astype(np.uint8).tobytes())
        f.write(scales.numpy().astype(np.float16).view("<u2").tobytes())
    return numpy_q4_0_linear(x.numpy(), raw)


def build(compiler: str, flags: list[str], out: Path) -> Path:
    done = subprocess.run(
        [compiler, "-std=c++17", "-O2", "-static", *flags, f"-I{INCLUDE}", str(SOURCE), "-o",
         str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_cases(command: list[str], variant: str, tmp: Path) -> str:
    """Runs every case through `variant`; returns the variant the program says it ran."""
    ran = set()
    for name, case in CASES.items():
        want = case_file(case, tmp / f"{name}.in")
        done = subprocess.run(
            [*command, variant, str(tmp / f"{name}.in"), str(tmp / f"{name}.out")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, (variant, name, done.stdout, done.stderr)
        got = np.fromfile(tmp / f"{name}.out", dtype="<f4").reshape(case.rows, case.n_out)
        # integer block sums: only the float32 sums of the blocks' products differ
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{variant} {name}")
        ran.add(done.stdout.strip())
    assert len(ran) == 1, ran
    return ran.pop()


@pytest.fixture(scope="module")
def arm64(tmp_path_factory) -> Path:
    if shutil.which(CROSS) is None or shutil.which(QEMU) is None:
        pytest.skip(MISSING)
    return build(CROSS, [], tmp_path_factory.mktemp("arm64") / "q4_0_check")


@pytest.mark.parametrize(
    "cpu, variant, runs",
    [
        ("max", "neon", "neon"),
        ("max", "neon-dotprod", "neon-dotprod"),
        ("max", "neon-i8mm", "neon-i8mm"),
        ("max", "best", "neon-i8mm"),  # chosen from HWCAP / HWCAP2
        ("cortex-a76", "best", "neon-dotprod"),  # Armv8.2 with dotprod, no i8mm
        ("cortex-a53", "best", "neon"),  # Armv8.0: no dot product
        ("cortex-a53", "portable", "portable"),
    ],
)
def test_arm64_variants_match_numpy(arm64, tmp_path, cpu, variant, runs):
    assert run_cases([QEMU, "-cpu", cpu, str(arm64)], variant, tmp_path) == runs


def test_arm64_refuses_a_variant_its_cpu_lacks(arm64, tmp_path):
    case_file(CASES["decode"], tmp_path / "in")
    done = subprocess.run(
        [QEMU, "-cpu", "cortex-a53", str(arm64), "neon-dotprod", str(tmp_path / "in"),
         str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3 and done.stdout.strip() == "unsupported neon-dotprod"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler (g++)")
@pytest.mark.parametrize(
    "flags, variant", [(["-march=x86-64-v3"], "avx2"), (["-march=x86-64"], "portable")]
)
def test_x86_variants_match_numpy(tmp_path, flags, variant):
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 vector targets")
    program = build("g++", flags, tmp_path / "q4_0_check")
    assert run_cases([str(program)], "best", tmp_path) == variant


def test_every_kernel_source_compiles_for_arm64(arm64, tmp_path):
    """The ExecuTorch operators themselves (attention, norms, the Q4_0 linear) as an arm64
    runtime compiles them, against the installed ExecuTorch's headers."""
    from edgemtp import native
    from edgemtp.runtime import kernels

    root = kernels.executorch_root()
    include = [f"-I{root / 'include'}", f"-I{root / native.C10_HEADERS}"]
    for source in (native.PACKAGE_ROOT / s for s in native.KERNELS.sources):
        done = subprocess.run(
            [CROSS, "-std=c++17", "-O2", "-fPIC", "-DC10_USING_CUSTOM_GENERATED_MACROS",
             *include, "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, (source.name, done.stderr[-3000:])


# --- the attention (runtime/kernels/cache_attention.h) ----------------------------------------

ATTENTION_SOURCE = ROOT / "tests" / "native" / "attention_check.cpp"


@pytest.fixture(scope="module")
def arm64_attention(tmp_path_factory) -> Path:
    if shutil.which(CROSS) is None or shutil.which(QEMU) is None:
        pytest.skip(MISSING)
    out = tmp_path_factory.mktemp("arm64") / "attention_check"
    done = subprocess.run(
        [CROSS, "-std=c++17", "-O2", "-static", f"-I{INCLUDE}", str(ATTENTION_SOURCE), "-o",
         str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def attention_file(case: AttentionCase, by_rows: bool, path: Path) -> np.ndarray:
    """Writes the program's input for `case`; returns numpy's attention in the layout asked."""
    inputs, allowed = case.inputs()
    q, k, v, k_new, v_new, mask = inputs
    fresh = 0 if k_new is None else k_new.shape[1]
    storage = 2 if case.int8 else int(case.half)  # float32, float16 or int8 rows
    shape = [*q.shape, *mask.shape, fresh, k.shape[1], storage, int(by_rows)]
    with path.open("wb") as f:
        f.write(np.array(shape, dtype="<i8").tobytes())
        f.write(q.numpy().astype("<f4").tobytes())
        for cache in (k, v):
            stored = ("<f4", "<f2", "i1")[storage]
            f.write(cache.numpy().astype(stored).tobytes())
        for own in (k_new, v_new):
            if own is not None:
                f.write(own.numpy().astype("<f4").tobytes())
        f.write(mask.numpy().astype("<f4").tobytes())
    want = numpy_attention(inputs, allowed)  # [kv_heads, group * rows, dim]
    if by_rows:  # row t: head kv * group + g from query row g * rows + t
        kv_heads, q_rows, dim = want.shape
        rows = mask.shape[0]
        want = want.reshape(kv_heads, q_rows // rows, rows, dim).transpose(2, 0, 1, 3)
        want = want.reshape(rows, -1)
    return want


@pytest.mark.parametrize("cpu", ["max", "cortex-a53"])
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_arm64_attention_matches_numpy(arm64_attention, tmp_path, cpu, name):
    """NEON's 4 lanes, its float16 and int8 widening and lane sums, on every case of the
    ExecuTorch kernel's tests (masked slots hold NaN: reading one would show), both layouts."""
    case = ATTENTION_CASES[name]
    for by_rows in (False, True):
        want = attention_file(case, by_rows, tmp_path / "in")
        done = subprocess.run(
            [QEMU, "-cpu", cpu, str(arm64_attention), str(tmp_path / "in"), str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        got = np.fromfile(tmp_path / "out", dtype="<f4").reshape(want.shape)
        assert np.isfinite(got).all(), f"{name}: read a slot it must not"
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{name} by_rows={by_rows}")

import contextlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)  # tiny models: waking a thread pool costs more than it saves


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def tiny_q4_0_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny preset and its assistant, random weights (std 0.05), quantized to Q4_0:
    (target folder, drafter folder), shared by every test module that exports them."""
    from edgemtp.model.synth import write_preset
    from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint

    root = tmp_path_factory.mktemp("tiny-q4_0")
    write_preset("tiny", root / "t", init_std=0.05)
    write_preset("tiny-assistant", root / "a", init_std=0.05)
    for role in ("t", "a"):
        quantize_checkpoint(root / role, root / f"q{role}", Settings(scheme="q4_0"))
    return root / "qt", root / "qa"


@pytest.fixture(scope="session")
def tiny_coreml_bundle(tiny_q4_0_pair, tmp_path_factory) -> Path:
    """The tiny pair exported to Core ML (npu; about a minute of coremltools conversion here),
    once for every test that reads a Core ML bundle's manifest: it cannot run on Linux."""
    from edgemtp.cli import main

    target, drafter = tiny_q4_0_pair
    out = tmp_path_factory.mktemp("coreml") / "bundle"
    assert main(
        [
            "export", "--model", str(target), "--drafter", str(drafter), "--backend", "coreml",
            "--delegate", "npu", "--max-context", "96", "--draft-depth", "2",
            "--prefill-chunk", "8", "--out", str(out),
        ]
    ) == 0  # fmt: skip
    return out


@dataclass(frozen=True)
class DemoRun:
    argv: list[str]
    bundle: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def demo_first_run(tmp_path_factory) -> DemoRun:
    """`edgemtp demo --json` run once into a fresh folder: it exports the embedded pair to its
    Q4_0 ExecuTorch bundle (about 2.5 minutes here), which every test that runs that bundle
    shares."""
    from edgemtp.cli import main

    bundle = tmp_path_factory.mktemp("demo") / "bundle"
    argv = ["demo", "--json", "--tokens", "24", "--repeat", "1", "--depth", "3"]
    argv += ["--out", str(bundle)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    return DemoRun(argv, bundle, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def core_build(tmp_path_factory) -> Path:
    """The apps' C++ decode core (`apps/core`) and its test programs, configured and built once,
    outside the repository."""
    import shutil
    import subprocess

    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: the C++ decode core cannot be built here")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    build = tmp_path_factory.mktemp("core-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    source = Path(__file__).resolve().parents[1] / "apps" / "core"
    from edgemtp import native
    from edgemtp.runtime import kernels

    # engine_run's kernels built as the library the Python runtime loads here
    flags = ";".join((*native.COMMON_FLAGS, *kernels.chosen_variant().flags))
    configure = ["cmake", "-S", str(source), "-B", str(build), *generator]
    for command in (
        [*configure, f"-DEDGEMTP_KERNEL_FLAGS={flags}"],
        ["cmake", "--build", str(build)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    return build

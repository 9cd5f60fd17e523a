"""Delegate capabilities: what runs on this host, and the reason named for what does not."""

from __future__ import annotations

import pytest

from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.capabilities import SUPPORTED, Host, _qnn_libraries, require, why_not

MAC = Host(
    "Darwin",
    "arm64",
    "15.2",
    executorch_backends=("CoreMLBackend", "XnnpackBackend"),
    onnx_providers=("CoreMLExecutionProvider", "CPUExecutionProvider"),
    coremltools=True,
)
SNAPDRAGON = Host(
    "Linux",
    "aarch64",
    executorch_backends=("QnnBackend", "XnnpackBackend"),
    onnx_providers=("CPUExecutionProvider", "QNNExecutionProvider"),
    qnn_libraries=True,
)
BARE_LINUX = Host("Linux", "x86_64")


def test_this_host_runs_the_cpu_bundles_and_names_what_it_lacks():
    host = Host.detect()
    table = {b: {d: why_not(b, d, host) for d in ds} for b, ds in SUPPORTED.items()}
    assert table["executorch"]["cpu"] is None  # the installed executorch has XNNPACK
    assert table["onnx"]["cpu"] is None
    assert "needs macOS 15+ (this host is Linux)" in table["coreml"]["npu"]
    assert "Snapdragon device (this host is Linux x86_64)" in table["executorch"]["htp"]
    assert "onnxruntime-qnn" in table["onnx"]["htp"]


def test_a_mac_runs_core_ml_and_the_core_ml_delegate():
    for delegate in ("cpu", "metal", "npu"):
        assert why_not("coreml", delegate, MAC) is None
    assert why_not("executorch", "npu", MAC) is None
    assert why_not("executorch", "cpu", MAC) is None
    assert "Snapdragon" in why_not("executorch", "htp", MAC)
    old = Host("Darwin", "arm64", "14.6", executorch_backends=(), coremltools=True)
    assert why_not("coreml", "npu", old) == (
        "running a Core ML bundle needs macOS 15+ (this host is macOS 14.6); update macOS: run "
        "it on a Mac, or export --backend executorch/onnx"
    )
    no_tools = Host("Darwin", "arm64", "15.0")
    assert why_not("coreml", "cpu", no_tools) == (
        "running a Core ML bundle needs coremltools: pip install coremltools"
    )
    xnnpack_only = Host("Darwin", "arm64", "15.0", executorch_backends=("XnnpackBackend",))
    assert "this executorch build has no CoreMLBackend (it has XnnpackBackend)" in why_not(
        "executorch", "metal", xnnpack_only
    )


def test_a_snapdragon_device_runs_qnn_with_its_libraries():
    assert why_not("executorch", "htp", SNAPDRAGON) is None
    assert why_not("onnx", "htp", SNAPDRAGON) is None
    without = Host("Linux", "aarch64", executorch_backends=("QnnBackend",))
    assert why_not("executorch", "htp", without) == (
        "the QNN HTP delegate needs Qualcomm's runtime libraries (libQnnHtp.so): install the "
        "Qualcomm AI Engine Direct SDK and set QNN_SDK_ROOT"
    )
    assert "Core ML delegate needs macOS 15+ (this host is Linux)" in why_not(
        "executorch", "metal", SNAPDRAGON
    )


def test_missing_runtimes_name_the_package():
    assert why_not("executorch", "cpu", BARE_LINUX) == (
        "running an ExecuTorch bundle needs executorch: pip install executorch==1.5.1"
    )
    assert why_not("onnx", "cpu", BARE_LINUX) == (
        "running an ONNX bundle needs onnxruntime: pip install onnxruntime"
    )
    with pytest.raises(EdgeMTPError, match="pip install onnxruntime$"):
        require("onnx", "cpu", BARE_LINUX)
    require("onnx", "htp", SNAPDRAGON)  # no error


def test_unknown_delegates_and_backends():
    assert "no 'gpu' delegate (it has cpu, metal, npu, htp)" in why_not("executorch", "gpu", MAC)
    assert "no 'npu' delegate (it has cpu, htp)" in why_not("onnx", "npu", MAC)
    assert "no 'htp' delegate (it has cpu, metal, npu)" in why_not("coreml", "htp", MAC)
    with pytest.raises(EdgeMTPError, match="unknown backend 'tflite'"):
        why_not("tflite", "cpu", MAC)


def test_qnn_libraries_are_found_under_the_sdk_or_the_library_path(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "nothing"))
    assert not _qnn_libraries()
    lib = tmp_path / "sdk" / "lib" / "aarch64-android"
    lib.mkdir(parents=True)
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    assert not _qnn_libraries()
    (lib / "libQnnHtp.so").write_bytes(b"\x7fELF")
    assert _qnn_libraries()
    monkeypatch.delenv("QNN_SDK_ROOT")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nowhere:{lib}")
    assert _qnn_libraries()

"""An export's memory: the estimate it prints and refuses by, and the guard that stops it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.export.memory import (
    PEAK_MODELS,
    MemoryGuard,
    Spill,
    estimated_peak,
    linear_elements,
    release_spilled,
    spill_module,
    spilling,
)
from edgemtp.model.synth import write_preset
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.probes import current_rss_mb


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("memory")
    return (
        write_preset("tiny", root / "t", init_std=0.05),
        write_preset("tiny-assistant", root / "a", init_std=0.05),
    )


def test_linear_elements_are_the_loaded_models_linears(pair):
    target_path, drafter_path = pair
    target = load_target(target_path)
    drafter = load_drafter(drafter_path, target.cfg)
    loaded = [m for model in (target.model, drafter.model) for m in model.modules()]
    want = sum(m.weight.numel() for m in loaded if isinstance(m, nn.Linear))
    assert linear_elements(target_path, drafter_path) == want
    only_target = sum(m.weight.numel() for m in target.model.modules() if isinstance(m, nn.Linear))
    assert linear_elements(target_path, None) == only_target < want


def test_the_estimate_grows_with_the_weights():
    for (backend, delegate), fit in PEAK_MODELS.items():
        small = estimated_peak(backend, delegate, 10**6)
        big = estimated_peak(backend, delegate, 10**9)
        assert small is not None and big is not None
        assert fit.base < small < big
    assert estimated_peak("executorch", "no-such-delegate", 10**9) is None


@pytest.mark.skipif(current_rss_mb() is None, reason="this platform does not report memory")
def test_the_guard_stops_the_main_thread_in_one_line():
    with pytest.raises(EdgeMTPError) as err:
        with MemoryGuard(limit=2**20, estimate=3 * 2**30, interval=0.01):
            time.sleep(10)  # interrupted within one sampling interval
    line = str(err.value)
    assert line.startswith("export stopped: it held ") and "over --max-memory 0.0 GiB" in line
    assert "estimated peak was 3.0 GiB" in line and "nothing was written" in line
    with MemoryGuard(limit=2**50, estimate=None, interval=0.01):
        time.sleep(0.05)  # under the limit: nothing happens


def test_max_memory_must_be_positive(pair, tmp_path, capsys):
    argv = ["export", "--model", str(pair[0]), "--backend", "onnx", "--max-memory", "0"]
    assert main([*argv, "--out", str(tmp_path / "b")]) != 0
    assert "--max-memory must be a positive number of GiB, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_an_estimate_over_max_memory_is_refused_before_any_work(pair, tmp_path, capsys):
    target, drafter = pair
    elements = linear_elements(target, drafter)
    estimate = estimated_peak("executorch", "cpu", elements)
    assert estimate is not None
    argv = ["export", "--model", str(target), "--drafter", str(drafter), "--backend"]
    argv += ["executorch", "--max-memory", "0.5", "--out", str(tmp_path / "b")]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert f"estimated peak memory {estimate / 2**30:.1f} GiB" in err  # printed first
    line = err.strip().splitlines()[-1]
    assert line == (
        f"edgemtp export: error: this export is estimated to peak at {estimate / 2**30:.1f} "
        "GiB, over --max-memory 0.5 GiB; nothing was done (raise --max-memory, or export on "
        "a machine with more memory)"
    )
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []


def test_a_spilled_tensor_keeps_its_values_after_its_pages_are_released(tmp_path):
    w = torch.randint(-8, 8, (1024, 2048), dtype=torch.int8)
    linear = nn.Linear(2048, 1024, bias=False)
    linear.weight.data = w.float()
    with spilling(tmp_path) as spill:
        out = spill.tensor(w)
        assert out is not w and torch.equal(out, w)
        small, view = w[:, :4].contiguous(), w[:8]
        assert spill.tensor(small) is small and spill.tensor(view) is view  # kept as they are
        spill_module(linear)
        release_spilled()
        assert torch.equal(out, w) and torch.equal(linear.weight, w.float())
        assert spill.bytes == w.numel() + 4 * w.numel()
        assert list(tmp_path.iterdir()) == []  # the files are unlinked: they go with the process


def test_a_spilled_export_writes_the_same_program(pair, tmp_path, monkeypatch, capsys):
    """Every weight form moved to files (none are big enough in a tiny model unless forced)
    changes nothing the program holds."""
    target, drafter = pair
    argv = ["export", "--model", str(target), "--drafter", str(drafter), "--quant", "q4_0"]
    argv += ["--backend", "executorch", "--max-context", "64"]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert "spilled" not in capsys.readouterr().err
    monkeypatch.setattr(Spill, "MIN_BYTES", 1)
    assert main([*argv, "--out", str(tmp_path / "spilled")]) == 0
    assert "weights spilled to disk while lowering" in capsys.readouterr().err
    plain = (tmp_path / "plain" / "model.pte").read_bytes()
    assert (tmp_path / "spilled" / "model.pte").read_bytes() == plain

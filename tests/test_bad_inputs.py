"""The README's bad-input table, row by row: each row's input is built here, its command run
as a user runs it, and the one line on stderr compared with the row, word for word (the
temporary folder reads DIR). A row without a case here, or a case without a row, fails."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from edgemtp.cli import main
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## What bad input looks like"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Good inputs the rows break: a tiny pair, its Q4_0 form, an ONNX bundle of it."""
    root = tmp_path_factory.mktemp("good")
    paths = {
        "target": write_preset("tiny", root / "t", init_std=0.05),
        "drafter": write_preset("tiny-assistant", root / "a", init_std=0.05),
        "other_drafter": write_preset("e2b-assistant", root / "o", scale=0.05),
    }
    paths["q4_0"] = root / "q"
    quantize_checkpoint(paths["target"], paths["q4_0"], Settings(scheme="q4_0"))
    paths["bundle"] = root / "bundle"
    argv = ["export", "--model", paths["target"], "--drafter", paths["drafter"], "--backend"]
    argv += ["onnx", "--max-context", "64", "--draft-depth", "2", "--out", paths["bundle"]]
    assert main([str(a) for a in argv]) == 0
    return paths


def _copy(src: Path, dst: Path) -> Path:
    return shutil.copytree(src, dst)


def _generate(model: Path, *extra: object) -> list[object]:
    return ["generate", "--model", model, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", *extra]


def _run(bundle: Path, *extra: object) -> list[object]:
    return [
        "generate",
        "--bundle",
        bundle,
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "4",
        *extra,
    ]


def _export(model: Path, out: Path, *extra: object) -> list[object]:
    return ["export", "--model", model, "--backend", "onnx", "--out", out, *extra]


def _config(folder: Path, **changes: object) -> Path:
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    for key, value in changes.items():
        if value is None:
            text.pop(key)
        else:
            text[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _safetensors_header(folder: Path, header: dict) -> Path:
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    return folder


def _manifest(bundle: Path, **changes: object) -> Path:
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    return bundle


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


# Each case: (the README row's first column) -> argv built in DIR from the good inputs.
Case = Callable[[Path, dict[str, Path]], list[object]]
CASES: dict[str, Case] = {
    "A model folder that does not exist": lambda d, m: _generate(d / "nowhere"),
    "A folder without config.json": lambda d, m: _generate(d),
    "config.json that is not JSON": lambda d, m: (
        (d / "config.json").write_text("{not json"),
        _generate(d),
    )[-1],
    "A model type other than Gemma 4": lambda d, m: (
        (d / "config.json").write_text(json.dumps({"model_type": "llama"})),
        _generate(d),
    )[-1],
    "A config field missing": lambda d, m: _generate(
        _config(_copy(m["target"], d / "t"), hidden_size=None)
    ),
    "A config field out of range": lambda d, m: _generate(
        _config(_copy(m["target"], d / "t"), num_key_value_heads=0)
    ),
    "A config declaring more weights than its checkpoint holds": lambda d, m: _generate(
        _config(_copy(m["target"], d / "t"), vocab_size=10**9)
    ),
    "Truncated safetensors": lambda d, m: _generate(_truncate(_copy(m["target"], d / "t"))),
    "A safetensors header declaring a terabyte tensor": lambda d, m: _generate(
        _safetensors_header(
            _copy(m["target"], d / "t"),
            {"w": {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}},
        )
    ),
    "A safetensors shape that disagrees with its offsets": lambda d, m: _generate(
        _safetensors_header(
            _copy(m["target"], d / "t"),
            {"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}},
        )
    ),
    "A tensor missing": lambda d, m: _generate(_drop_tensor(_copy(m["target"], d / "t"))),
    "A pickled checkpoint (.bin, .pt, .ckpt)": lambda d, m: _generate(
        _pickled(_copy(m["target"], d / "t"))
    ),
    "A truncated or non-GGUF file": lambda d, m: (
        (d / "m.gguf").write_bytes(b"not a gguf file at all" * 10),
        _generate(d / "m.gguf"),
    )[-1],
    "A GGUF declaring 10⁹ tensors": lambda d, m: (
        (d / "m.gguf").write_bytes(struct.pack("<IIQQ", 0x46554747, 3, 10**9, 1) + bytes(64)),
        _generate(d / "m.gguf"),
    )[-1],
    "A drafter trained for another target": lambda d, m: _generate(
        m["target"], "--drafter", m["other_drafter"]
    ),
    "A drafter passed as the target": lambda d, m: _generate(m["drafter"]),
    "Prompt ids outside the vocabulary": lambda d, m: [
        "generate",
        "--model",
        m["target"],
        "--prompt-ids",
        "5,99999",
        "--max-new-tokens",
        "4",
    ],  # fmt: skip
    "A delegate the backend cannot target": lambda d, m: [
        *_export(m["target"], d / "out"),
        "--backend",
        "coreml",
        "--delegate",
        "htp",
    ],  # fmt: skip
    "Re-quantizing a quantized checkpoint": lambda d, m: [
        *_export(m["q4_0"], d / "out"),
        "--quant",
        "w4a16",
    ],  # fmt: skip
    "A context longer than the model attends to": lambda d, m: [
        *_export(m["target"], d / "out"),
        "--max-context",
        "1000000",
    ],  # fmt: skip
    "Draft chains on a backend without them": lambda d, m: [
        *_export(m["target"], d / "out"),
        "--drafter",
        m["drafter"],
        "--draft-chains",
    ],  # fmt: skip
    "Verify depths that leave out AR decode": lambda d, m: [
        *_export(m["target"], d / "out"),
        "--drafter",
        m["drafter"],
        "--verify-depths",
        "1,3",
    ],  # fmt: skip
    "An output folder that exists": lambda d, m: (
        (d / "out").mkdir(),
        _export(m["target"], d / "out"),
    )[-1],
    "A folder that is not a bundle": lambda d, m: _run(d),
    "A bundle file changed after export": lambda d, m: (
        _flip_last_byte((b := _copy(m["bundle"], d / "b")) / "tables.safetensors"),
        _run(b),
    )[-1],
    "A bundle from a newer edgemtp": lambda d, m: _run(
        _manifest(_copy(m["bundle"], d / "b"), schema_version=2, edgemtp_version="0.9.0")
    ),
    "A manifest naming a file outside the bundle": lambda d, m: _run(
        _manifest(_copy(m["bundle"], d / "b"), program="../../etc/passwd")
    ),
    "A bundle for a runtime this host lacks": lambda d, m: _run(
        _manifest(_copy(m["bundle"], d / "b"), backend="coreml", delegate="npu")
    ),
    "A draft depth the bundle was not exported for": lambda d, m: _run(m["bundle"], "--mtp", "3"),
    "A prompt longer than the bundle's context": lambda d, m: [
        "generate",
        "--bundle",
        m["bundle"],
        "--prompt-ids",
        ",".join(["5"] * 64),
        "--max-new-tokens",
        "4",
    ],  # fmt: skip
}


def _truncate(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def _drop_tensor(folder: Path) -> Path:
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _pickled(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle (of the int 1)
    return folder


def readme_rows() -> dict[str, str]:
    """The table under SECTION: first column -> last column (without the backticks)."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no '{SECTION}' section"
    table = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and not set(cells[0]) <= {"-", ":"} and cells[0] != "Bad input":
            rows[cells[0]] = re.sub(r"^`|`$", "", cells[2])
    return rows


def test_every_row_has_a_case_and_every_case_a_row():
    assert sorted(readme_rows()) == sorted(CASES)


@pytest.mark.parametrize("row", list(CASES))
def test_the_row_is_what_the_user_sees(row, made, tmp_path, capsys):
    argv = [str(a) for a in CASES[row](tmp_path, made)]
    code = main(argv)
    *progress, last = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and all(line.startswith("-- ") for line in progress), progress
    seen = last.replace(str(tmp_path), "DIR").replace(str(made["target"].parent), "GOOD")
    assert seen == readme_rows()[row]
    if "--out" in argv:  # nothing half-written next to the output
        out = Path(argv[argv.index("--out") + 1])
        assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []

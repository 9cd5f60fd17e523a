"""No code runs from a model file: no pickle, no `torch.load` without `weights_only=True`, no
eval/exec, no template rendering, in any module that reads outside input; and a checkpoint
folder holding only a pickle is refused without unpickling it."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest

from edgemtp.cli import main
from edgemtp.model.synth import preset_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("cli", "model", "quantize", "export", "runtime", "devices", "train")
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve", "jinja2"}


def _modules() -> list[Path]:
    files = [ROOT / "errors.py"]
    for folder in PACKAGE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _violations(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.parent.name}/{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            out += [f"{where} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if func in ("eval", "exec", "compile", "__import__"):
            out.append(f"{where} calls {func}")
        if func.endswith("torch.load") and keywords.get("weights_only") != "True":
            out.append(f"{where} torch.load without weights_only=True")
        if func.endswith(("np.load", "numpy.load")) and keywords.get("allow_pickle") == "True":
            out.append(f"{where} np.load with allow_pickle=True")
    return out


def test_no_module_can_run_code_from_a_file():
    modules = _modules()
    assert len(modules) > 40  # the scan sees the package
    assert [v for path in modules for v in _violations(path)] == []


def test_the_scan_catches_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport torch\nx = torch.load('f')\ny = torch.load('f', weights_only=False)"
        "\neval('1')\nimport numpy as np\nz = np.load('f', allow_pickle=True)\n"
    )
    found = _violations(bad)
    assert len(found) == 5, found


class _Payload:
    """Unpickling this writes a marker file: the proof that a loader ran code from a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.ckpt"])
def test_a_pickled_checkpoint_is_refused_unopened(tmp_path, capsys, name):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset_config("tiny")))
    marker = tmp_path / "marker"
    (folder / name).write_bytes(pickle.dumps(_Payload(marker)))
    code = main(["generate", "--model", str(folder), "--prompt-ids", "1", "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "convert .bin/.pt files first" in err[0]
    assert not marker.exists()

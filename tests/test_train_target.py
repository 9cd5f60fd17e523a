"""The embedded default target: stdlib data, its tokenizer, and pre-training (tiny sizes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.model.forward import forward_rows
from edgemtp.quantize.load import load_target
from edgemtp.runtime.tokenizer import load_tokenizer
from edgemtp.train import data, pretrain

# ~1 MB of real stdlib code: enough text for an 8192-token BPE, small enough to train in seconds.
_SUBSET = ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "inspect.py", "typing.py")
_SUBSET_DIRS = ("json", "email", "asyncio")


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small stdlib-like tree, with things that must be left out."""
    root = tmp_path_factory.mktemp("stdlib")
    src = data.stdlib_dir()
    for name in _SUBSET:
        shutil.copy(src / name, root / name)
    for d in _SUBSET_DIRS:
        shutil.copytree(src / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    for skipped in ("test", "site-packages", "idlelib", "email/tests", "encodings"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "skipped.py").write_text("x = 1\n")
    (root / "huge.py").write_text("x = 1\n" * 40_000)  # > 200 kB
    (root / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture(scope="module")
def data_dir(corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    return data.prepare(out, corpus_root, log=lambda _msg: None)


def test_source_files_exclusions(corpus_root: Path) -> None:
    files = data.source_files(corpus_root)
    assert files == sorted(files) and "argparse.py" in files and "json/decoder.py" in files
    assert not any(f.startswith(("test/", "site-packages/", "idlelib/")) for f in files)
    assert "email/tests/skipped.py" not in files and "huge.py" not in files
    assert "encodings/skipped.py" not in files
    assert all(f.endswith(".py") for f in files)


def test_the_real_stdlib_is_found() -> None:
    files = data.source_files()
    assert len(files) > 300 and "os.py" in files
    assert not any("/test/" in f or f.startswith("test/") for f in files)


def test_split_deterministic_and_disjoint(corpus_root: Path, tmp_path: Path) -> None:
    files = data.source_files(corpus_root)
    a, b = data.split_files(files), data.split_files(reversed(files))
    assert a == b
    assert set(a["train"]).isdisjoint(a["held_out"])
    assert sorted(a["train"] + a["held_out"]) == files
    full = data.split_files(data.source_files())
    share = len(full["held_out"]) / (len(full["train"]) + len(full["held_out"]))
    assert 0.02 < share < 0.09  # ~5 %


def test_splits_and_manifest(data_dir: Path, corpus_root: Path, tmp_path: Path) -> None:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert "PSF" in manifest["license"] and manifest["python_version"]
    again = data.write_splits(tmp_path, corpus_root)
    for name in data.SPLITS:
        split = manifest["splits"][name]
        assert split["sha256"] == again["splits"][name]["sha256"]  # deterministic bytes
        assert split["bytes"] == (data_dir / f"{name}.txt").stat().st_size
        docs = data.read_split(data_dir, name)
        assert len(docs) == split["files"] == len(split["paths"])
    first = manifest["splits"]["train"]["paths"][0]
    original = (corpus_root / first).read_text(encoding="utf-8")
    assert data.read_split(data_dir, "train")[0] == original


def test_held_out_prompts(data_dir: Path) -> None:
    held_out = data.read_split(data_dir, "held_out")
    train = "".join(data.read_split(data_dir, "train"))
    prompts = data.held_out_prompts(data_dir, 3, context_lines=5)
    assert 1 <= len(prompts) <= 3
    for prompt in prompts:
        lines = prompt.split("\n")
        assert lines[-1] == "" and len(lines) <= 6  # 5 lines, the last a one-line signature
        assert lines[-2].lstrip().startswith(("def ", "async def ")) and lines[-2].endswith(":")
        assert any(prompt in doc for doc in held_out)
    assert data.held_out_prompts(data_dir, 1, context_lines=5) == prompts[:1]
    # the split really holds out: no held-out file is inside the training text
    assert not any(doc in train for doc in held_out if len(doc) > 200)


def test_tokenizer_vocab_special_ids_and_round_trip(data_dir: Path) -> None:
    tok = load_tokenizer(data_dir)
    assert tok is not None
    raw = tok.tokenizer
    assert raw.get_vocab_size() == data.VOCAB_SIZE == 8192
    assert [raw.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>")] == [0, 1, 2]
    assert tok.extra_stop_ids == (raw.token_to_id("<turn|>"),)
    held = data.read_split(data_dir, "held_out") or data.read_split(data_dir, "train")[-1:]
    samples = [
        "def f(x):\n\treturn x  # tab, unicode: é ü 😀\r\n",
        "    \n\n   trailing spaces   \n",
        held[0],
    ]
    for text in samples:
        ids = tok.encode_prompt(text)
        assert ids[0] == data.BOS_ID
        assert tok.decode(ids) == text
    cfg = pretrain.embedded_config()
    assert (cfg["pad_token_id"], cfg["eos_token_id"], cfg["bos_token_id"]) == (0, 1, 2)


def test_token_streams(data_dir: Path) -> None:
    ids = data.load_ids(data_dir, "train")
    assert ids.dtype == np.uint16 and ids.max() < data.VOCAB_SIZE
    assert (ids == data.EOS_ID).sum() == len(data.read_split(data_dir, "train"))


def test_default_config_size() -> None:
    from edgemtp.model.config import parameter_count, parse_text_config

    cfg = parse_text_config(pretrain.embedded_config())
    assert 10e6 <= parameter_count(cfg) <= 30e6
    assert {"sliding", "full"} == set(cfg.layer_types) and cfg.num_kv_shared_layers > 0
    assert cfg.hidden_size_per_layer_input and cfg.final_logit_softcapping == 30.0
    assert cfg.vocab_size % 64 == 0


def _tiny_model(seed: int = 0) -> pretrain.TrainModel:
    return pretrain.build_model(pretrain.config_for("tiny"), seed)


def test_training_lowers_loss_and_reaches_every_parameter(data_dir: Path) -> None:
    torch.manual_seed(0)
    model = _tiny_model()
    stream = data.load_ids(data_dir, "train")
    ids = pretrain.random_batch(stream, 4, 48, np.random.default_rng(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with torch.enable_grad():
        for step in range(8):
            loss = pretrain.loss_fn(model, ids)
            opt.zero_grad()
            loss.backward()
            if step == 0:
                no_grad = [
                    n
                    for n, p in model.named_parameters()
                    if p.grad is None or not p.grad.abs().sum() > 0
                ]
                assert no_grad == []
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    # the tables are trainable parameters, the token table tied with the head
    names = dict(model.named_parameters())
    assert "per_layer_table" in names and "target.lm_head.weight" in names
    assert model.tables.tokens.table is model.target.lm_head.weight


def test_batched_forward_equals_per_sequence() -> None:
    model = _tiny_model()
    ids = torch.randint(0, 8192, (3, 20))
    batched = model(ids)
    for i in range(3):
        torch.testing.assert_close(batched[i], model.sequence_logits(ids[i]))


def _trained_checkpoint(data_dir: Path, out: Path, steps: int = 3) -> dict:
    argv = ["--data", str(data_dir), "--out", str(out), "--steps", str(steps), "--size", "tiny"]
    argv += [
        "--threads",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--eval-seqs",
        "4",
        "--log-every",
        "1",
    ]
    with torch.enable_grad():
        return pretrain.train(pretrain.parse_args(argv), log=lambda _msg: None)


def test_checkpoint_loads_and_matches_training_model(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "target"
    report = _trained_checkpoint(data_dir, out)
    assert report["steps"] == 3 and report["held_out_loss"] > 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json"):
        assert (out / name).is_file()
    assert sorted(p.name for p in out.iterdir() if p.suffix not in (".json", ".safetensors")) == []
    state = torch.load(pretrain.state_path(out), weights_only=False)
    model = pretrain.build_model(state["config"])
    model.load_state_dict(state["model"])
    model.eval()

    target = load_target(out)
    tok = load_tokenizer(out)
    assert tok is not None
    ids = torch.tensor(tok.encode_prompt("def main(argv):\n    parser = argparse.")[:24])
    expected = model.sequence_logits(ids)
    cache = KVCache(target.cfg, 64)
    hidden = forward_rows(target, cache, ids, "all")
    assert hidden is not None
    torch.testing.assert_close(target.model.logits(hidden), expected, atol=1e-4, rtol=1e-4)

    # independent oracle: transformers' Gemma 4 reads the same checkpoint
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_logits = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(hf_logits, expected, atol=1e-4, rtol=1e-4)


def test_resume_continues(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "target"
    _trained_checkpoint(data_dir, out, steps=2)
    argv = ["--data", str(data_dir), "--out", str(out), "--steps", "4", "--size", "tiny"]
    argv += ["--threads", "1", "--batch", "2", "--seq", "32", "--eval-seqs", "2", "--resume"]
    with torch.enable_grad():
        report = pretrain.train(pretrain.parse_args(argv), log=lambda _msg: None)
    assert report["steps"] == 4 and report["tokens_seen"] == 4 * 2 * 31
    assert len(report["commands"]) == 2 and report["commands"][1].endswith("--resume")


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--steps", "1"]
    with pytest.raises(EdgeMTPError, match="nothing to resume"):
        pretrain.train(pretrain.parse_args([*args, "--resume"]), log=lambda _msg: None)
    with pytest.raises(EdgeMTPError, match="missing"):
        data.load_ids(tmp_path / "nowhere", "train")
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--data", "d", "--out", "o"])  # neither --minutes nor --steps
    assert pretrain.main([*args, "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err

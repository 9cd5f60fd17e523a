"""`edgemtp generate` / `synth` as a user runs them: output formats and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from edgemtp.cli import main
from edgemtp.model.synth import write_preset
from edgemtp.runtime.session import Session


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    return write_preset("tiny", root / "t"), write_preset("tiny-assistant", root / "a")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(capsys, *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    return lines[0]


def test_generate_json_with_mtp(tiny, capsys):
    target, drafter = tiny
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        target,
        "--drafter",
        drafter,
        "--prompt-ids",
        "2,10,11,12",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert code == 0
    payload = json.loads(out.strip().splitlines()[-1])
    assert len(payload["tokens"]) == 12
    metrics = payload["metrics"]
    for key in (
        "ttft_s",
        "prefill_tok_s",
        "decode_tok_s",
        "target_forwards",
        "drafted",
        "accepted",
        "mean_committed_per_forward",
    ):
        assert key in metrics
    assert metrics["drafted"] > 0
    assert sum(s["committed"] for s in payload["trace"] if s["kind"] == "decode") == 11

    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        target,
        "--prompt-ids",
        "2,10,11,12",
        "--max-new-tokens",
        "12",
        "--json",
        "--mtp",
        "0",
    )
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == payload["tokens"]


def test_text_prompt_streams_text(tiny, tmp_path, capsys):
    target, _ = tiny
    model = tmp_path / "with-tokenizer"
    shutil.copytree(target, model)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.save(str(model / "tokenizer.json"))
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        model,
        "--prompt",
        "the quick fox",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
    )
    payload = json.loads(out.strip().splitlines()[-1])
    assert payload["prompt_ids"] == tok.encode("the quick fox").ids
    assert isinstance(payload["text"], str)
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--chat",
        "--max-new-tokens",
        "4",
        "--json",
    )
    prompt_ids = json.loads(out.strip().splitlines()[-1])["prompt_ids"]
    assert prompt_ids[0] == tok.token_to_id("<start_of_turn>")
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        model,
        "--prompt",
        "the dog",
        "--max-new-tokens",
        "5",
        "--ignore-eos",
    )
    assert code == 0 and "5 tokens" in err


def test_missing_folder_and_config(tmp_path, capsys):
    assert "no such directory" in error_line(
        capsys,
        "generate",
        "--model",
        tmp_path / "nope",
        "--prompt-ids",
        "1",
        "--max-new-tokens",
        "1",
    )
    assert "no config.json" in error_line(
        capsys, "generate", "--model", tmp_path, "--prompt-ids", "1", "--max-new-tokens", "1"
    )


def test_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    line = error_line(
        capsys, "generate", "--model", tmp_path, "--prompt-ids", "1", "--max-new-tokens", "1"
    )
    assert "unsupported model_type 'llama'" in line


def test_corrupt_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    line = error_line(
        capsys, "generate", "--model", tmp_path, "--prompt-ids", "1", "--max-new-tokens", "1"
    )
    assert "not valid JSON" in line


def test_truncated_safetensors(tiny, tmp_path, capsys):
    target, _ = tiny
    bad = tmp_path / "t"
    shutil.copytree(target, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = error_line(
        capsys, "generate", "--model", bad, "--prompt-ids", "1", "--max-new-tokens", "1"
    )
    assert "truncated" in line and "model.safetensors" in line


def test_missing_tensor(tiny, tmp_path, capsys):
    target, _ = tiny
    bad = tmp_path / "t"
    shutil.copytree(target, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    line = error_line(
        capsys, "generate", "--model", bad, "--prompt-ids", "1", "--max-new-tokens", "1"
    )
    assert "'model.layers.2.mlp.up_proj.weight' is missing" in line


def test_drafter_for_another_target(tiny, tmp_path, capsys):
    target, _ = tiny
    other = write_preset("e2b-assistant", tmp_path / "other", scale=0.05)
    line = error_line(
        capsys,
        "generate",
        "--model",
        target,
        "--drafter",
        other,
        "--prompt-ids",
        "1",
        "--max-new-tokens",
        "1",
    )
    assert "drafter does not match this target" in line and "vocab_size 262144" in line


def test_target_passed_as_drafter_and_bad_ids(tiny, capsys):
    target, drafter = tiny
    line = error_line(
        capsys, "generate", "--model", drafter, "--prompt-ids", "1", "--max-new-tokens", "1"
    )
    assert "pass it as --drafter" in line
    line = error_line(
        capsys, "generate", "--model", target, "--prompt-ids", "1,99999", "--max-new-tokens", "1"
    )
    assert "outside the vocabulary" in line
    line = error_line(
        capsys, "generate", "--model", target, "--prompt", "hello", "--max-new-tokens", "1"
    )
    assert "no tokenizer.json" in line


def test_synth_refuses_to_overwrite(tiny, capsys):
    target, _ = tiny
    line = error_line(capsys, "synth", "--preset", "tiny", "--out", target)
    assert "already exists" in line


def test_ctrl_c_during_generate_stops_with_the_tokens_so_far(tiny):
    """A real SIGINT while tokens stream: the round in flight finishes, the tokens so far are
    printed and summed up, exit status 130."""
    import os
    import signal
    import subprocess
    import sys

    target, drafter = tiny
    cmd = [
        sys.executable, "-m", "edgemtp.cli", "generate", "--model", str(target), "--drafter",
        str(drafter), "--mtp", "2", "--prompt-ids", "5,6,7", "--max-new-tokens", "4000",
        "--max-context", "4096", "--ignore-eos",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    streamed = b""
    while streamed.count(b" ") < 20:  # tokens stream as "id " with a flush per round
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, proc.stderr.read().decode()
        streamed += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    tokens = (streamed + out).split()
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 130, err.decode()
    assert lines[-1] == f"edgemtp generate: interrupted after {len(tokens)} tokens"
    assert lines[-2].startswith(f"-- {len(tokens)} tokens, ") and "Traceback" not in err.decode()
    assert 20 <= len(tokens) < 4000


def test_export_with_a_verify_per_depth(tiny, tmp_path, capsys):
    """`--verify-depths all`: a verify method per draft depth, recorded in the manifest; a
    depth-1 round runs verify_1 (not verify_2 padded) and keeps AR's tokens."""
    target, drafter = tiny
    bundle = tmp_path / "b"
    argv = ["export", "--model", target, "--drafter", drafter, "--backend", "onnx"]
    argv += ["--quant", "none", "--activations", "fp32", "--max-context", "64"]
    argv += ["--draft-depth", "2", "--verify-depths", "all", "--out", bundle]
    assert run(capsys, *argv)[0] == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["shapes"]["verify_depths"] == [0, 1, 2]
    assert {"verify_0", "verify_1", "verify_2"} <= set(manifest["methods"])
    tokens = {}
    for depth in (0, 1):
        argv = ["generate", "--bundle", bundle, "--prompt-ids", "2,10,11,12"]
        code, out, _ = run(capsys, *argv, "--max-new-tokens", "12", "--json", "--mtp", depth)
        assert code == 0
        tokens[depth] = json.loads(out.strip().splitlines()[-1])["tokens"]
    assert tokens[1] == tokens[0]
    session = Session.from_bundle(bundle)
    session.generate([2, 10, 11, 12], 12, mtp=1, stop_ids=())
    assert session.backend.calls["verify_1"] > 0 and "verify_2" not in session.backend.calls

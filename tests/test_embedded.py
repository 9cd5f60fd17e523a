"""The embedded default pair (`checkpoints/`): what ships, how it is released, that it drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.model.embedded import ASSISTANT, PROMPTS, TARGET
from edgemtp.model.synth import write_preset
from edgemtp.quantize.load import load_drafter, load_target, open_checkpoint
from edgemtp.runtime.session import Session
from edgemtp.runtime.tokenizer import load_tokenizer
from edgemtp.train.release import release


def test_release_is_bf16_and_loads_the_same_model(tmp_path: Path) -> None:
    write_preset("tiny", tmp_path / "t", dtype="float32", init_std=0.05)
    write_preset("tiny-assistant", tmp_path / "a", dtype="float32")
    release(tmp_path / "t", tmp_path / "t16")
    release(tmp_path / "a", tmp_path / "a16")
    with pytest.raises(EdgeMTPError, match="already exists"):
        release(tmp_path / "t", tmp_path / "t16")
    assert not (tmp_path / "t16.tmp").exists()

    for name in ("t", "a"):
        src, dst = open_checkpoint(tmp_path / name), open_checkpoint(tmp_path / f"{name}16")
        assert sorted(src.names()) == sorted(dst.names())
        for tensor in src.names():
            a, b = src.tensor(tensor), dst.tensor(tensor)
            if a.is_floating_point():
                assert b.dtype == torch.bfloat16
                torch.testing.assert_close(b.float(), a.to(torch.bfloat16).float(), atol=0, rtol=0)
            else:  # the assistant's token ordering: exact
                assert torch.equal(a, b)
        assert json.loads((tmp_path / f"{name}16" / "config.json").read_text())["dtype"] == (
            "bfloat16"
        )
    size = (tmp_path / "t16" / "model.safetensors").stat().st_size
    assert size < 0.55 * (tmp_path / "t" / "model.safetensors").stat().st_size

    target = load_target(tmp_path / "t16")
    load_drafter(tmp_path / "a16", target.cfg)


# --- the shipped pair ------------------------------------------------------------------------

shipped = pytest.mark.skipif(
    not (TARGET / "config.json").is_file(), reason="checkpoints/embedded-* not in this checkout"
)


@shipped
def test_shipped_target_has_every_gemma4_feature() -> None:
    target = load_target(TARGET)
    cfg = target.cfg
    kinds = {layer.attention for layer in cfg.layers}
    assert kinds == {"sliding", "full"}
    assert cfg.hidden_size_per_layer_input > 0  # per-layer embeddings
    assert 0 < cfg.num_kv_shared_layers < cfg.num_layers  # KV-shared layers and stores
    assert cfg.final_logit_softcapping
    stored = open_checkpoint(TARGET)  # the PLE table is read by rows, not a module parameter
    params = sum(stored.tensor(n).numel() for n in stored.names())
    assert 10e6 <= params <= 30e6
    tokenizer = load_tokenizer(TARGET)
    assert tokenizer is not None
    assert tokenizer.tokenizer.get_vocab_size() == cfg.vocab_size == 8192
    drafter = load_drafter(ASSISTANT, cfg)
    assert cfg.vocab_size % drafter.cfg.num_centroids == 0
    for folder in (TARGET, ASSISTANT):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


@shipped
def test_shipped_pair_drafts_well_on_the_demo_prompts() -> None:
    """Greedy, float reference: MTP commits the AR tokens, several per target forward."""
    session = Session.from_checkpoints(TARGET, ASSISTANT, max_context=512, max_draft=3)
    assert session.tokenizer is not None
    texts = json.loads(PROMPTS.read_text())
    assert len(texts) >= 3
    rates, ar = {}, {}
    for depth in (0, 2, 3):
        committed = forwards = 0
        for i, text in enumerate(texts):
            session.reset()
            ids = session.tokenizer.encode_prompt(text)
            result = session.generate(ids, 48, mtp=depth, stop_ids=())
            if depth == 0:
                ar[i] = result.tokens
            assert result.tokens == ar[i]
            decode = [s for s in result.steps if s.kind == "decode"]
            committed += sum(s.committed for s in decode)
            forwards += len(decode)
        rates[depth] = committed / forwards
    assert rates[0] == 1.0
    assert rates[2] >= 1.8 and rates[3] >= 2.1, rates


@shipped
def test_demo_exports_once_and_reports_mtp_against_ar(demo_first_run, capsys) -> None:
    """`edgemtp demo --json`: the embedded pair lowered to a Q4_0 ExecuTorch bundle (once), MTP
    and AR on the same prompts, the figures as one JSON object; the second run reuses the
    bundle."""
    out, argv = demo_first_run.bundle, demo_first_run.argv
    result = json.loads(demo_first_run.stdout)
    assert "exporting the embedded pair" in demo_first_run.stderr
    for key in ("ar_decode_tok_s", "mtp_decode_tok_s", "speedup", "mean_committed_per_forward"):
        assert result[key] > 0, key
    assert result["speedup"] == pytest.approx(
        result["mtp_decode_tok_s"] / result["ar_decode_tok_s"]
    )
    assert result["depth"] == 3 and result["bundle"] == str(out)
    assert result["mean_committed_per_forward"] >= 1.8
    # lossless but at near-ties (verify_3 and verify_0 round differently): most runs equal
    assert result["mtp_runs_equal_ar"] >= result["prompts"] - 1
    assert len(result["text"].strip()) > 20  # decoded text, not token ids
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "executorch" and manifest["quantization"]["scheme"] == "q4_0"
    # a verify per depth and greedy draft chains: one drafter call and no padded rows a round
    rounds = {f"verify_{k}" for k in range(4)} | {f"draft_{k}" for k in (1, 2, 3)}
    assert rounds <= set(manifest["methods"]), sorted(manifest["methods"])
    stamp = (out / "manifest.json").stat().st_mtime_ns

    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "(cached)" in captured.err and "exporting" not in captured.err
    assert json.loads(captured.out)["bundle"] == str(out)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp

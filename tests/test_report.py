"""The quantization report against hand-computed numbers."""

from __future__ import annotations

import json

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from edgemtp.cli import main
from edgemtp.model.cache import KVCache
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.quality import build_report, next_token_stats

IDS = [int(i) for i in torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0))]


def test_report_numbers(tmp_path, capsys):
    float_dir = write_preset("tiny", tmp_path / "f", init_std=0.06)
    drafter_dir = write_preset("tiny-assistant", tmp_path / "d")
    q_dir = tmp_path / "q"
    quantize_checkpoint(float_dir, q_dir, Settings(scheme="q4_0", ple="fp16"))
    ref, q = load_target(float_dir), load_target(q_dir)

    n, kl, agree, ppl_f, ppl_q = next_token_stats(ref, ref, IDS)
    assert n == len(IDS) - 1 and abs(kl) < 1e-12 and agree == 1.0 and ppl_f == ppl_q

    report = build_report(ref, q, IDS[:101], (load_drafter(drafter_dir, ref.cfg),) * 2)
    inputs, labels = torch.tensor(IDS[:100]), torch.tensor(IDS[1:101])
    logp = []
    for t in (ref, q):
        h, _ = t.model(
            t.tables.embed(inputs),
            t.tables.per_layer_inputs(inputs),
            torch.arange(100),
            KVCache(t.cfg, 100),
            "all",
        )
        logp.append(torch.log_softmax(t.model.logits(h).double(), -1).numpy())
    f, g = logp
    assert np.isclose(report.kl_mean, (np.exp(f) * (f - g)).sum(1).mean(), rtol=1e-9)
    assert report.top1_agreement == (f.argmax(1) == g.argmax(1)).mean()
    nll = -f[np.arange(100), labels.numpy()].mean()
    assert np.isclose(report.ppl_float, np.exp(nll), rtol=1e-9)
    assert 0 < report.kl_mean and report.top1_agreement < 1.0

    name = "model.layers.3.mlp.gate_proj.weight"
    w = load_file(float_dir / "model.safetensors")[name].float().numpy()
    wq = gguf.quants.dequantize(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0
    )
    assert np.isclose(report.weight_error[name], np.linalg.norm(w - wq) / np.linalg.norm(w))
    assert report.weight_error["model.embed_tokens_per_layer.weight"] < 1e-3  # fp16 table
    assert report.acceptance_float is not None and report.acceptance_quantized is not None

    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(" ".join(map(str, IDS)))
    out = tmp_path / "rep" / "r"
    code = main(
        [
            "quantize-report",
            "--model",
            str(float_dir),
            "--quantized",
            str(q_dir),
            "--text",
            str(ids_file),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert json.loads(out.with_suffix(".json").read_text())["tokens"] == len(IDS) - 1
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "top-1 agreement" in capsys.readouterr().out

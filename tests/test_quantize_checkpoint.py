"""Quantized checkpoints: ours (Q4_0 / W4A16) and compressed-tensors' own, through the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import build_target
from safetensors.torch import load_file, save_file

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_target
from edgemtp.quantize.tables import Int8Rows, Q4_0Rows

IDS = torch.tensor([2, 17, 99, 5, 64, 3, 120, 7, 7, 41, 88, 12])


def logits(target) -> torch.Tensor:
    hidden, _ = target.model(
        target.tables.embed(IDS),
        target.tables.per_layer_inputs(IDS),
        torch.arange(len(IDS)),
        KVCache(target.cfg, 32),
        "all",
    )
    return target.model.logits(hidden)


def float_copy(folder: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A float HF folder with `weights` (the quantized model's dequantized weights)."""
    out.mkdir()
    (out / "config.json").write_text(
        json.dumps(
            {
                k: v
                for k, v in json.loads((folder / "config.json").read_text()).items()
                if k not in ("quantization_config", "edgemtp_quantization")
            }
        )
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("q") / "float"
    build_target(root, hidden_size_per_layer_input=32)
    return root


def test_q4_0_checkpoint_is_ggml_exact_and_runs_on_its_dequantized_weights(hf_folder, tmp_path):
    out = tmp_path / "q4"
    summary = quantize_checkpoint(hf_folder, out, Settings(scheme="q4_0", ple="int8"))
    assert summary["kept_fp16"] == []
    original = load_file(hf_folder / "model.safetensors")
    stored = load_file(out / "model.safetensors")
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.5.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        ref = gguf.quants.quantize(original[name].float().numpy(), gguf.GGMLQuantizationType.Q4_0)
        ours = stored[name.removesuffix("weight") + "weight_q4_0"].numpy()
        assert np.array_equal(ours, ref), name
    assert "model.embed_tokens_per_layer.weight_int8" in stored

    quantized = load_target(out)
    assert isinstance(quantized.tables.tokens, Q4_0Rows)
    assert isinstance(quantized.tables.per_layer, Int8Rows)
    source = quantized.source
    dequantized = {name: source.tensor(name) for name in source.names()}
    for name, ref in dequantized.items():
        if name.endswith("_proj.weight"):
            want = gguf.quants.dequantize(
                gguf.quants.quantize(
                    original[name].float().numpy(), gguf.GGMLQuantizationType.Q4_0
                ),
                gguf.GGMLQuantizationType.Q4_0,
            )
            assert np.array_equal(ref.numpy(), want), name
    reference = load_target(float_copy(out, tmp_path / "deq", dequantized))
    assert (logits(quantized) - logits(reference)).abs().max() <= 1e-5
    assert (
        logits(quantized) - logits(load_target(hf_folder))
    ).abs().max() > 1e-3  # it is quantized


def test_w4a16_checkpoint_written_by_compressed_tensors(tmp_path):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    hf = build_target(tmp_path / "src", hidden_size_per_layer_input=32).to(torch.bfloat16)
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
        format="pack-quantized",
    )
    apply_quantization_config(hf, config, show_progress=False)
    for module in hf.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            scale, zp = compute_dynamic_scales_and_zp(module.weight, scheme.weights, module)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format="pack-quantized")
    compressor.compress_model(hf)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    folder = tmp_path / "ct"
    folder.mkdir()
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = json.loads(json.dumps(compressor.quantization_config.model_dump()))
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, folder / "model.safetensors")

    target = load_target(folder)
    name = "model.layers.2.mlp.up_proj"
    q = target.source.quantized(name + ".weight")
    codes = unpack_from_int32(state[name + ".weight_packed"], 4, state[name + ".weight_shape"])
    zp = unpack_from_int32(
        state[name + ".weight_zero_point"],
        4,
        torch.Size(
            [state[name + ".weight_scale"].shape[0], state[name + ".weight_scale"].shape[1]]
        ),
        packed_dim=0,
    )
    assert torch.equal(q.codes.to(torch.int8), (codes + 8).to(torch.int8))  # unsigned, as stored
    assert torch.equal(q.scales, state[name + ".weight_scale"])
    # the float model with compressed-tensors' values dequantized by hand
    weights = {}
    for key in target.source.names():
        base = key.removesuffix(".weight")
        if base + ".weight_packed" in state:
            c = unpack_from_int32(state[base + ".weight_packed"], 4, state[base + ".weight_shape"])
            s = state[base + ".weight_scale"].float()
            z = unpack_from_int32(
                state[base + ".weight_zero_point"], 4, torch.Size(s.shape), packed_dim=0
            )
            g = c.shape[1] // s.shape[1]
            weights[key] = (c.float() - z.float().repeat_interleave(g, 1)) * s.repeat_interleave(
                g, 1
            )
        else:
            weights[key] = state[key]
    assert zp.shape == q.scales.shape
    reference = load_target(float_copy(folder, tmp_path / "deq", weights))
    assert (logits(target) - logits(reference)).abs().max() <= 1e-5


def test_our_w4a16_output_decompresses_with_compressed_tensors(hf_folder, tmp_path):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "w4"
    quantize_checkpoint(hf_folder, out, Settings(scheme="w4a16", group_size=32, embeddings="fp16"))
    config = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )
    stored = load_file(out / "model.safetensors")
    target = load_target(out)
    for name in ("model.layers.1.self_attn.o_proj", "model.per_layer_model_projection"):
        layer = {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(name + ".")}
        decompressed = PackedQuantizationCompressor.decompress(
            layer, config.config_groups["group_0"]
        )["weight"]
        ours = target.source.tensor(name + ".weight")
        assert torch.equal(ours.to(decompressed.dtype), decompressed), name
    assert "lm_head" in config.ignore  # the tied head is the token table, set by --embeddings


def test_bad_inputs_leave_nothing_behind(hf_folder, tmp_path, capsys):
    bad = tmp_path / "nan"
    bad.mkdir()
    (bad / "config.json").write_text((hf_folder / "config.json").read_text())
    weights = load_file(hf_folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, bad / "model.safetensors")
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(bad), "--scheme", "q4_0", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # progress lines, then one error line
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("edgemtp quantize: error: model.layers.1.mlp.up_proj.weight")
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]

    q4 = tmp_path / "q4"
    quantize_checkpoint(hf_folder, q4, Settings())
    config = json.loads((q4 / "config.json").read_text())
    config["edgemtp_quantization"]["version"] = 99
    (q4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgeMTPError, match="version 99"):
        load_target(q4)
    config["edgemtp_quantization"]["version"] = 1
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8}}},
    }
    (q4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgeMTPError, match="int-quantized"):
        load_target(q4)


def test_quantized_pair_decodes_with_mtp(tmp_path):
    from edgemtp.model.synth import write_preset
    from edgemtp.quantize.load import load_drafter
    from edgemtp.runtime.generate import generate

    target_dir = write_preset("tiny", tmp_path / "t")
    drafter_dir = write_preset("tiny-assistant", tmp_path / "a")
    for name, folder in (("tq", target_dir), ("aq", drafter_dir)):
        quantize_checkpoint(folder, tmp_path / name, Settings(scheme="q4_0", ple="q4_0"))
    target = load_target(tmp_path / "tq")
    drafter = load_drafter(tmp_path / "aq", target.cfg)
    assert drafter.source.quantized("pre_projection.weight") is not None
    assert drafter.source.quantized("masked_embedding.centroids.weight") is not None
    ar = generate(target, [2, 10, 11, 12], 40)
    mtp = generate(target, [2, 10, 11, 12], 40, drafter=drafter, mtp_depth=3)
    assert mtp.tokens == ar.tokens


@pytest.mark.parametrize("scheme", ["q4_0", "w4a16"])
def test_4bit_linears_without_floats_compute_the_same(tmp_path, scheme):
    """`float_4bit=False` (what exports load): a linear stored in 4 bits holds no float weight,
    yet each use gives the eager load's dequantized weight, so decoding is token-identical."""
    from torch import nn

    from edgemtp.export.weights import StoredInt4, attach_int4, int4_of, int4_weight
    from edgemtp.model.checkpoint import StoredLinear
    from edgemtp.model.synth import write_preset
    from edgemtp.runtime.generate import generate

    write_preset("tiny", tmp_path / "t", init_std=0.05)
    quantize_checkpoint(tmp_path / "t", tmp_path / "q", Settings(scheme=scheme, group_size=32))
    eager = load_target(tmp_path / "q")
    lazy = load_target(tmp_path / "q", float_4bit=False)
    stored = [n for n, m in lazy.model.named_modules() if isinstance(m, StoredLinear)]
    four_bit = [
        n
        for n, m in eager.model.named_modules()
        if isinstance(m, nn.Linear) and eager.source.quantized(eager.names[f"{n}.weight"])
    ]
    assert stored == four_bit and "layers.0.mlp.down_proj" in stored
    held = set(lazy.model.state_dict())
    assert not held & {f"{n}.weight" for n in stored}
    assert set(eager.model.state_dict()) - held == {f"{n}.weight" for n in stored}
    for n in stored:
        assert torch.equal(lazy.model.get_submodule(n).weight, eager.model.get_submodule(n).weight)
    prompt = [2, 10, 11, 12, 40, 7]
    assert generate(lazy, prompt, 24).tokens == generate(eager, prompt, 24).tokens
    # what exports attach: where each 4-bit weight is, read only when a form asks for it
    attach_int4(lazy.model, lazy.source, lazy.names)
    for n, m in lazy.model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        name = lazy.names[f"{n}.weight"]
        if n not in stored:
            assert m.int4 is None and lazy.source.scheme_4bit(name) is None
            continue
        want = int4_weight(lazy.source.quantized(name))  # a tied head is Q4_0 in any scheme
        assert isinstance(m.int4, StoredInt4) and m.int4.scheme == want.scheme
        assert want.scheme == scheme or name == "model.embed_tokens.weight"
        got = int4_of(m)
        assert got is not None and got.scheme == want.scheme and got.group == want.group
        for field in ("codes", "scales", "zeros"):
            assert torch.equal(getattr(got, field), getattr(want, field))


def test_4bit_linear_of_another_shape_is_refused_without_floats(tmp_path):
    from edgemtp.model.synth import write_preset

    write_preset("tiny", tmp_path / "t", init_std=0.05)
    quantize_checkpoint(tmp_path / "t", tmp_path / "q", Settings(scheme="q4_0"))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["intermediate_size"] *= 2
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgeMTPError, match=r"gate_proj.weight' has shape \[128, 64\], the config"):
        load_target(tmp_path / "q", float_4bit=False)

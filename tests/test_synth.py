"""Synthetic presets: HF layout (transformers loads them), true shapes, determinism, sharding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import (
    check_drafter_matches,
    parameter_count,
    parse_assistant_config,
    parse_text_config,
)
from edgemtp.model.synth import PRESETS, preset_config, tensor_specs, write_preset

transformers = pytest.importorskip("transformers")


def _load(path: Path) -> tuple[torch.nn.Module, dict]:
    cfg = json.loads((path / "config.json").read_text())
    cls = (
        transformers.Gemma4AssistantForCausalLM
        if cfg["model_type"] == "gemma4_assistant"
        else transformers.Gemma4ForCausalLM
    )
    model, info = cls.from_pretrained(path, output_loading_info=True)
    return model, info


def _stored(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return out


def _assert_loads_exactly(path: Path) -> torch.nn.Module:
    model, info = _load(path)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    stored = _stored(path)
    state = model.state_dict()
    assert set(stored) <= set(state)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name
    return model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("synth")
    return write_preset("tiny", root / "tiny"), write_preset("tiny-assistant", root / "tiny-a")


def test_tiny_target_loads_in_transformers(tiny_pair: tuple[Path, Path]) -> None:
    model = _assert_loads_exactly(tiny_pair[0])
    assert model.dtype == torch.bfloat16
    text = parse_text_config(json.loads((tiny_pair[0] / "config.json").read_text()))
    assert text.store_layers == {"sliding": 3, "full": 4}
    assert text.sliding_window == 16 and text.use_double_wide_mlp
    assert text.hidden_size_per_layer_input and text.final_logit_softcapping == 30.0
    layers = model.model.layers
    assert layers[9].mlp.gate_proj.out_features == 2 * layers[0].mlp.gate_proj.out_features
    assert layers[4].self_attn.head_dim == 32 and layers[3].self_attn.head_dim == 16
    assert torch.all(layers[0].layer_scalar == 1) and torch.all(model.model.norm.weight == 1)
    w = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    out = model(torch.arange(3, 43).unsqueeze(0)).logits  # longer than the sliding window
    assert out.shape == (1, 40, 512) and torch.isfinite(out).all()
    assert out.abs().max() <= 30.0


def test_tiny_assistant_loads_and_drafts(tiny_pair: tuple[Path, Path]) -> None:
    assistant = _assert_loads_exactly(tiny_pair[1])
    order = assistant.masked_embedding.token_ordering
    assert order.dtype == torch.int64
    assert torch.equal(order.sort().values, torch.arange(512))
    gen = json.loads((tiny_pair[1] / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == 2
    target_cfg = json.loads((tiny_pair[0] / "config.json").read_text())
    drafter_cfg = json.loads((tiny_pair[1] / "config.json").read_text())
    check_drafter_matches(parse_text_config(target_cfg), parse_assistant_config(drafter_cfg))
    # The pair works together in transformers' assisted (MTP) generation, greedy == AR.
    target = transformers.Gemma4ForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32)
    drafter = transformers.Gemma4AssistantForCausalLM.from_pretrained(
        tiny_pair[1], dtype=torch.float32
    )
    ids = torch.arange(5, 35).unsqueeze(0)
    ar = target.generate(ids, max_new_tokens=8, do_sample=False)
    mtp = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter)
    assert torch.equal(ar, mtp)


def test_tiny_is_fast(tmp_path: Path) -> None:
    import time

    start = time.perf_counter()
    write_preset("tiny", tmp_path / "a")
    write_preset("tiny-assistant", tmp_path / "b")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("preset", "hidden", "layers", "shared", "stores", "kv_heads", "params"),
    [
        ("e2b", 1536, 35, 20, {"sliding": 13, "full": 14}, 1, 4.6e9),
        # (E4B's shared layers keep its MLP width: only E2B's config sets use_double_wide_mlp)
        ("e4b", 2560, 42, 18, {"sliding": 22, "full": 23}, 2, 7.46e9),
    ],
)
def test_full_size_target_configs(
    preset: str,
    hidden: int,
    layers: int,
    shared: int,
    stores: dict[str, int],
    kv_heads: int,
    params: float,
) -> None:
    cfg = preset_config(preset)
    assert cfg["architectures"] == ["Gemma4ForCausalLM"] and cfg["model_type"] == "gemma4_text"
    text = parse_text_config(cfg)
    assert (text.hidden_size, text.num_layers, text.num_kv_shared_layers) == (
        hidden,
        layers,
        shared,
    )
    assert text.store_layers == stores
    period = 5 if preset == "e2b" else 6
    assert text.layer_types == tuple(
        "full" if i % period == period - 1 else "sliding" for i in range(layers)
    )
    full = [s for s in text.layers if s.attention == "full"]
    assert all(s.head_dim == 512 for s in full)
    assert all(s.head_dim == 256 for s in text.layers if s.attention == "sliding")
    assert {s.num_kv_heads for s in text.layers} == {kv_heads}
    wide = 2 if preset == "e2b" else 1
    assert text.layers[-1].intermediate_size == wide * text.layers[0].intermediate_size
    assert text.hidden_size_per_layer_input == 256 and text.vocab_size == 262_144
    assert text.vocab_size_per_layer_input == 262_144 and text.sliding_window == 512
    assert set(cfg["per_layer_config"]) == {f"{s.index:02d}" for s in full}
    assert abs(parameter_count(text) / params - 1) < 0.03
    # The tensors we would write agree with the parser's parameter count exactly.
    assert sum(t.numel for t in tensor_specs(cfg)) == parameter_count(text)
    # transformers accepts the config as is.
    hf = transformers.Gemma4TextConfig(**cfg)
    assert hf.kv_sharing_modes[stores["sliding"]] == "store"
    assert hf.per_layer_config[stores["full"]].head_dim == 512


def test_peer_90m_is_the_benchmark_shape() -> None:
    """BRIEF §10's "PEER-90M": hidden 512, 12 layers (4 sliding : 1 full, the last full), 7
    KV-shared layers with store layers 3 and 4, 4 heads, 1 KV head, head_dim 128 / 256, MLP 2048
    (not double-wide), PLE 64, vocab 32768, window 512, soft-cap 30, ~90 M parameters."""
    cfg = preset_config("peer-90m")
    text = parse_text_config(cfg)
    assert text.layer_types == ("sliding",) * 4 + ("full",) + ("sliding",) * 4 + (
        "full",
        "sliding",
        "full",
    )
    assert (text.hidden_size, text.num_kv_shared_layers, text.store_layers) == (
        512,
        7,
        {"sliding": 3, "full": 4},
    )
    assert {s.intermediate_size for s in text.layers} == {2048}
    assert {(s.attention, s.head_dim, s.num_kv_heads) for s in text.layers} == {
        ("sliding", 128, 1),
        ("full", 256, 1),
    }
    assert (text.num_heads, text.hidden_size_per_layer_input, text.vocab_size) == (4, 64, 32_768)
    assert (text.sliding_window, text.final_logit_softcapping) == (512, 30.0)
    assert abs(parameter_count(text) / 90e6 - 1) < 0.02
    assert sum(t.numel for t in tensor_specs(cfg)) == parameter_count(text)
    hf = transformers.Gemma4TextConfig(**cfg)
    assert [hf.kv_sharing_modes[i] for i in (3, 4)] == ["store", "store"]


@pytest.mark.parametrize(("preset", "target"), [("e2b-assistant", "e2b"), ("e4b-assistant", "e4b")])
def test_full_size_assistant_configs(preset: str, target: str) -> None:
    cfg = preset_config(preset)
    assert cfg["model_type"] == "gemma4_assistant"
    assistant = parse_assistant_config(cfg)
    text = assistant.text
    assert (text.hidden_size, text.num_layers, text.num_heads) == (256, 4, 4)
    assert text.layer_types == ("sliding", "sliding", "sliding", "full")
    assert text.intermediate_size == 2048 and text.num_kv_shared_layers == 4
    assert (assistant.num_centroids, assistant.centroid_top_k) == (2048, 32)
    check_drafter_matches(parse_text_config(preset_config(target)), assistant)
    total = sum(t.numel for t in tensor_specs(cfg) if t.init != "permutation")
    assert abs(total / 78e6 - 1) < 0.03
    assert abs(parameter_count(text) / 78e6 - 1) < 0.03  # decoder + tied table dominate
    transformers.Gemma4AssistantConfig(**cfg).validate_architecture()


def test_scaled_pair_writes_loads_and_matches(tmp_path: Path) -> None:
    target_dir = write_preset("e2b", tmp_path / "e2b", scale=0.05)
    drafter_dir = write_preset("e2b-assistant", tmp_path / "e2b-a", scale=0.05)
    target = parse_text_config(json.loads((target_dir / "config.json").read_text()))
    drafter = parse_assistant_config(json.loads((drafter_dir / "config.json").read_text()))
    check_drafter_matches(target, drafter)
    assert target.hidden_size == 64 and target.num_layers == 10
    assert target.layer_types == ("sliding",) * 4 + ("full",) + ("sliding",) * 4 + ("full",)
    assert target.store_layers == {"sliding": 3, "full": 4}
    assert target.hidden_size_per_layer_input % 8 == 0
    assert (target.vocab_size, target.sliding_window) == (262_144, 512)
    assert target.head_dim_of("full") == 512 and target.kv_heads_of("sliding") == 1
    model = _assert_loads_exactly(target_dir)
    assert len(model.model.layers) == 10
    _assert_loads_exactly(drafter_dir)


def test_scale_keeps_structure() -> None:
    for preset in ("e2b", "e4b"):
        period = 5 if preset == "e2b" else 6
        for scale in (0.1, 0.3, 0.5, 0.75, 1.0):
            text = parse_text_config(preset_config(preset, scale))
            assert text.num_layers % period == 0 and text.num_kv_shared_layers % period == 0
            first = text.first_shared_layer
            assert text.store_layers == {"sliding": first - 2, "full": first - 1}
            assert text.hidden_size % 64 == 0 and text.intermediate_size % 64 == 0
            assert text.layer_types[-1] == "full"
            drafter = parse_assistant_config(preset_config(f"{preset}-assistant", scale))
            check_drafter_matches(text, drafter)
    with pytest.raises(EdgeMTPError, match="scale"):
        preset_config("e2b", 0)
    with pytest.raises(EdgeMTPError, match="scale"):
        preset_config("e2b", 1.5)
    with pytest.raises(EdgeMTPError, match="unknown preset"):
        preset_config("e9b")
    assert set(PRESETS) == {
        "e2b",
        "e4b",
        "e2b-assistant",
        "e4b-assistant",
        "tiny",
        "tiny-assistant",
        "peer-90m",
    }


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_deterministic(tmp_path: Path) -> None:
    a = _bytes(write_preset("tiny-assistant", tmp_path / "a", seed=3))
    b = _bytes(write_preset("tiny-assistant", tmp_path / "b", seed=3, workers=1))
    c = _bytes(write_preset("tiny-assistant", tmp_path / "c", seed=4))
    assert a == b
    assert a["config.json"] == c["config.json"]
    assert a["model.safetensors"] != c["model.safetensors"]


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    single = write_preset("tiny", tmp_path / "single", dtype="float32")
    messages: list[str] = []
    sharded = write_preset(
        "tiny", tmp_path / "sharded", dtype="float32", shard_size=600_000, progress=messages.append
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(
        t.numel * 4 for t in tensor_specs(preset_config("tiny"))
    )
    assert any(m.startswith("[2/") for m in messages)
    model = _assert_loads_exactly(sharded)
    assert model.dtype == torch.float32
    one, many = _stored(single), _stored(sharded)
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)


def test_dtypes(tmp_path: Path) -> None:
    half = _stored(write_preset("tiny", tmp_path / "f16", dtype="float16"))
    full = _stored(write_preset("tiny", tmp_path / "f32", dtype="float32"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert half[name].dtype == torch.float16 and full[name].dtype == torch.float32
    np.testing.assert_array_equal(half[name].numpy(), full[name].half().numpy())
    with pytest.raises(EdgeMTPError, match="dtype"):
        write_preset("tiny", tmp_path / "x", dtype="int8")


def test_refuses_non_empty_out_dir(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(EdgeMTPError, match="not empty"):
        write_preset("tiny", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_preset("tiny", empty)
    assert (empty / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    def boom(message: str) -> None:
        if "layers.3." in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_preset("tiny", tmp_path / "out", progress=boom)
    assert list(tmp_path.iterdir()) == []

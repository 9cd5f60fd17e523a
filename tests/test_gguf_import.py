"""GGUF import: tiny Gemma 4 checkpoints written the way llama.cpp's converter writes them.

`write_gguf` mirrors `Gemma4Model` in llama.cpp's converter: gguf-py's tensor-name map (with the
`.weight` suffix added to `layer_scalar`), norms stored as they are, `rope_freqs` for the full
layers' proportional RoPE, the `gemma4.*` key-values, and 1-D tensors / columns that are not a
multiple of 32 kept unquantized (F32 / F16).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hf_oracle import build_target, layer_types
from safetensors.torch import load_file, save_file
from transformers import Gemma4ForCausalLM

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.model.config import parse_text_config
from edgemtp.quantize.gguf_import import GGUFSource, Q8_0Rows, dequantize_q8_0
from edgemtp.quantize.load import load_target, open_checkpoint
from edgemtp.quantize.q4_0 import pack_q4_0
from edgemtp.quantize.tables import Q4_0Rows

TOL = 1e-4
TABLES = ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight")
# 8 layers S S F S S F | S F: the store layers (4 sliding, 5 full) sit right before the two
# KV-shared layers, as llama.cpp requires.
TYPES = layer_types(2, 6) + ["sliding_attention", "full_attention"]
BASE = dict(num_hidden_layers=8, layer_types=TYPES, num_kv_shared_layers=2)


def build_hf(path: Path, seed: int = 0, **overrides) -> Gemma4ForCausalLM:
    """A tiny random target with random norms and layer scalars too (so that a mixed-up norm
    mapping cannot hide behind weights that are all ones)."""
    model = build_target(path, seed=seed, **{**BASE, **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        if p.ndim == 1:
            p.data = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    model.save_pretrained(path)
    return model


def write_gguf(
    hf_dir: Path,
    out: Path,
    linear: T = T.Q4_0,
    tables: T = T.Q4_0,
    arch: str = "gemma4",
    types: dict[str, T] | None = None,
    replace: dict[str, np.ndarray] | None = None,
    drop_keys: tuple[str, ...] = (),
) -> dict[str, tuple[T, np.ndarray]]:
    """Convert an HF folder as llama.cpp's converter does; returns GGUF name -> (type, data)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    full = swa.index(False)
    over = cfg["per_layer_config"][str(full)]
    hd_full, hd_swa = over["head_dim"], cfg["head_dim"]
    kv_swa = cfg["num_key_value_heads"]
    kv_full = over.get("num_key_value_heads", kv_swa)
    first_shared = n - cfg["num_kv_shared_layers"]
    ff = cfg["intermediate_size"]
    rope = cfg["rope_parameters"]

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    written: dict[str, tuple[T, np.ndarray]] = {}
    for name, t in tensors.items():
        new = gguf_name(names, name)
        x = t.float().numpy()
        if x.ndim == 1:
            kind = T.F32
        else:
            kind = tables if name.endswith(TABLES) else linear
            if x.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
                kind = T.F16  # as the converter does for rows that are not whole blocks
        kind = (types or {}).get(new, kind)
        written[new] = (kind, x)
    pairs = int(hd_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    freqs = np.array([1.0] * pairs + [1e30] * (hd_full // 2 - pairs), dtype=np.float32)
    written["rope_freqs.weight"] = (T.F32, freqs)
    for key, x in (replace or {}).items():
        written[key] = (written[key][0], x)

    w = gguf.GGUFWriter(out, arch)
    kv: dict[str, object] = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": hidden,
        "block_count": n,
        "feed_forward_length": [ff if i < first_shared else 2 * ff for i in range(n)]
        if cfg["use_double_wide_mlp"]
        else ff,
        "head_count": cfg["num_attention_heads"],
        "head_count_kv": [kv_swa if s else kv_full for s in swa] if kv_full != kv_swa else kv_swa,
        "rope_freq_base": rope["full_attention"]["rope_theta"],
        "rope_freq_base_swa": rope["sliding_attention"]["rope_theta"],
        "layer_norm_rms_eps": cfg["rms_norm_eps"],
        "key_length": hd_full,
        "value_length": hd_full,
        "key_length_swa": hd_swa,
        "value_length_swa": hd_swa,
        "final_logit_softcapping": cfg["final_logit_softcapping"],
        "sliding_window": cfg["sliding_window"],
        "shared_kv_layers": cfg["num_kv_shared_layers"],
        "embedding_length_per_layer_input": cfg["hidden_size_per_layer_input"],
        "sliding_window_pattern": swa,
        "rope_dimension_count": hd_full,
        "rope_dimension_count_swa": hd_swa,
    }
    for key, value in kv.items():
        getattr(w, "add_" + key)(value)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gemma4")
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    for key in drop_keys:
        del w.kv_data[0][key]
    for new, (kind, x) in written.items():
        if kind == T.F32:
            data = x.astype(np.float32)
        elif kind == T.F16:
            data = x.astype(np.float16)
        else:
            with np.errstate(all="ignore"):
                data = gguf.quants.quantize(x, kind)
        written[new] = (kind, data)
        w.add_tensor(new, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    """The converter's GGUF name: `layer_scalar` gains a `.weight` suffix, then gguf-py maps."""
    src = hf_name + ".weight" if hf_name.endswith("layer_scalar") else hf_name
    new = names.get_name(src, try_suffixes=(".weight", ".bias"))
    assert new is not None, hf_name
    return new


def stored_as_torch(kind: T, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """What the GGUF holds, by gguf-py's reference: floats in their dtype, quants dequantized."""
    if kind in (T.F32, T.F16):
        return torch.from_numpy(data.copy())
    if kind == T.BF16:
        return torch.from_numpy(data.copy().view(np.int16).reshape(shape)).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(shape))


def write_reference(written: dict[str, tuple[T, np.ndarray]], hf_dir: Path, out: Path) -> Path:
    """An HF folder with the GGUF's weights (found through the converter's own name map and
    decoded by gguf-py, not by the code under test) and the original config.json."""
    out.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg["num_hidden_layers"])
    tensors = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        kind, data = written[gguf_name(names, name)]
        tensors[name] = stored_as_torch(kind, data, tuple(t.shape)).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", out / "config.json")
    return out


def logits(target, ids: torch.Tensor, decode: int = 3) -> torch.Tensor:
    """Prefill `ids[:-decode]`, then decode the rest one token at a time; all logits stacked."""
    cache = KVCache(target.cfg, 64)
    out = []
    for chunk in [ids[:-decode], *ids[-decode:].split(1)]:
        start = cache.length
        positions = torch.arange(start, start + len(chunk))
        tables = target.tables
        hidden, new_kv = target.model(
            tables.embed(chunk), tables.per_layer_inputs(chunk), positions, cache
        )
        cache.write(new_kv, start)
        out.append(target.model.logits(hidden))
    return torch.cat(out)


def hf_logits(model: Gemma4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None], output_hidden_states=True).logits[0]


IDS = torch.tensor([2, 17, 99, 5, 64, 3, 127, 40, 41, 8, 1, 77, 12, 90])


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> tuple[Path, Path, dict[str, tuple[T, np.ndarray]]]:
    root = tmp_path_factory.mktemp("gguf")
    build_hf(root / "hf")
    written = write_gguf(root / "hf", root / "model.gguf")
    return root / "hf", root / "model.gguf", written


# --- the model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tables", [T.Q4_0, T.F16])
@pytest.mark.parametrize(
    "overrides", [{}, dict(attention_k_eq_v=True, num_global_key_value_heads=2)]
)
def test_logits_match_dequantized_folder_and_transformers(tmp_path, tables, overrides):
    hf_dir, path = tmp_path / "hf", tmp_path / "m.gguf"
    build_hf(hf_dir, **overrides)
    written = write_gguf(hf_dir, path, tables=tables)
    src = open_checkpoint(path)
    assert isinstance(src, GGUFSource)
    original = json.loads((hf_dir / "config.json").read_text())
    assert parse_text_config(src.config) == parse_text_config(original)
    ref_dir = write_reference(written, hf_dir, tmp_path / "ref")

    got = logits(load_target(path), IDS)
    want = logits(load_target(ref_dir), IDS)
    assert (got - want).abs().max() <= TOL
    if tables == T.Q4_0:  # every table float32: transformers sees the very same weights
        hf = Gemma4ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        assert (hf_logits(hf, IDS) - got).abs().max() <= TOL


def test_config_and_names(q4):
    hf_dir, path, written = q4
    src = GGUFSource(path)
    original = json.loads((hf_dir / "config.json").read_text())
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "layer_types",
        "sliding_window",
        "rope_parameters",
        "rms_norm_eps",
        "final_logit_softcapping",
        "hidden_size_per_layer_input",
        "vocab_size_per_layer_input",
        "num_kv_shared_layers",
        "use_double_wide_mlp",
        "attention_k_eq_v",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    ):
        assert src.config[key] == original[key], key
    stored = load_file(hf_dir / "model.safetensors")
    assert sorted(src.names()) == sorted(stored)
    for name, t in stored.items():
        assert tuple(src.tensor(name).shape) == tuple(t.shape), name
        assert src.tensor(name).dtype == torch.float32
        if t.ndim == 1:  # norms and scalars: F32, exactly as in the checkpoint (no +1 shift)
            assert torch.equal(src.tensor(name), t), name
    assert src.gguf_name("model.layers.3.layer_scalar") == "blk.3.layer_output_scale.weight"
    assert "rope_freqs.weight" in written and "rope_freqs.weight" not in src.names()


def test_quantized_returns_the_written_bytes(q4):
    _, path, written = q4
    src = GGUFSource(path)
    n_q4 = 0
    for name in src.names():
        kind, data = written[src.gguf_name(name)]
        q = src.quantized(name)
        if kind == T.Q4_0:
            n_q4 += 1
            assert src.shape_4bit(name) == q.shape and src.scheme_4bit(name) == "q4_0"
            np.testing.assert_array_equal(pack_q4_0(q), data)
            ref = gguf.quants.dequantize(data, T.Q4_0)
            np.testing.assert_array_equal(src.tensor(name).numpy(), ref)
        else:
            assert q is None and src.scheme_4bit(name) is None
    assert n_q4 > 20


def test_logits_equal_without_float_copies_of_4bit_linears(q4):
    _, path, _ = q4
    got = logits(load_target(path, float_4bit=False), IDS)
    assert torch.equal(got, logits(load_target(path), IDS))


def test_tables_look_up_rows_without_dequantizing(q4):
    _, path, written = q4
    src = GGUFSource(path)
    ids = torch.tensor([0, 127, 5, 5, 64])
    for name in TABLES:
        table = src.table(name)
        assert isinstance(table, Q4_0Rows) and isinstance(table.raw, np.memmap)
        full = gguf.quants.dequantize(written[src.gguf_name(name)][1], T.Q4_0)
        np.testing.assert_array_equal(table[ids].numpy(), full[ids.numpy()])
        assert torch.equal(table[ids], src.tensor(name)[ids])


@pytest.mark.parametrize(
    "linear,tables", [(T.Q8_0, T.Q8_0), (T.BF16, T.BF16), (T.F16, T.F32), (T.Q4_0, T.Q8_0)]
)
def test_q8_0_and_float_types(tmp_path, linear, tables):
    hf_dir, path = tmp_path / "hf", tmp_path / "m.gguf"
    build_hf(hf_dir)
    written = write_gguf(hf_dir, path, linear=linear, tables=tables)
    src = GGUFSource(path)
    ids = torch.tensor([3, 0, 127, 3])
    for name in src.names():
        kind, data = written[src.gguf_name(name)]
        want = gguf.quants.dequantize(data, kind) if kind not in (T.F32, T.F16) else data
        np.testing.assert_array_equal(src.tensor(name).numpy(), np.asarray(want, np.float32))
        if name.endswith(TABLES):
            table = src.table(name)
            if kind == T.Q8_0:
                assert isinstance(table, Q8_0Rows)
            else:  # the mapped file itself, no copy
                assert (
                    isinstance(table, torch.Tensor) and table.data_ptr() == src.raw(name).data_ptr()
                )
                assert table.dtype == {T.F32: torch.float32, T.F16: torch.float16}.get(
                    kind, torch.bfloat16
                )
            np.testing.assert_array_equal(table[ids].float().numpy(), want[ids.numpy()])
    ref_dir = write_reference(written, hf_dir, tmp_path / "ref")
    got = logits(load_target(path), IDS)
    assert (got - logits(load_target(ref_dir), IDS)).abs().max() <= TOL


@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (3, 4096), (64,)])
def test_dequantize_q8_0_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.reshape(-1)[:32] = 0.0  # an all-zero block
    x.reshape(-1)[-1] = 1e4
    raw = gguf.quants.quantize(x, T.Q8_0)
    ref = gguf.quants.dequantize(raw, T.Q8_0)
    got = dequantize_q8_0(raw, shape)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.int32), ref.view(np.int32))
    np.testing.assert_array_equal(dequantize_q8_0(raw.tobytes(), shape).numpy(), ref)
    if len(shape) == 2:
        rows = Q8_0Rows(raw, shape[1])
        np.testing.assert_array_equal(rows[torch.tensor([0, shape[0] - 1])].numpy(), ref[[0, -1]])
    with pytest.raises(EdgeMTPError, match="do not hold a Q8_0"):
        dequantize_q8_0(raw, (shape[0] + 1, *shape[1:]))


# --- the command line --------------------------------------------------------------------------


def generate(capsys, model: Path) -> list[int]:
    argv = ["generate", "--model", str(model), "--prompt-ids", "1,2,3"]
    code = main([*argv, "--max-new-tokens", "4", "--json", "--ignore-eos"])
    out, _ = capsys.readouterr()
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])["tokens"]


def test_cli_generates_from_gguf(q4, tmp_path, capsys):
    hf_dir, path, written = q4
    code = main(
        ["generate", "--model", str(path), "--prompt-ids", "1,2,3"]
        + ["--max-new-tokens", "4", "--json"]
    )
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"]
    ref = write_reference(written, hf_dir, tmp_path / "ref")
    tokens = generate(capsys, path)
    assert len(tokens) == 4 and tokens == generate(capsys, ref)


# --- bad files ---------------------------------------------------------------------------------


def error_line(capsys, path: Path) -> str:
    code = main(["generate", "--model", str(path), "--prompt-ids", "1", "--max-new-tokens", "1"])
    _, err = capsys.readouterr()
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    return lines[0]


def test_truncated_and_garbage_files(q4, tmp_path, capsys):
    _, path, _ = q4
    data = path.read_bytes()
    for name, blob in [
        ("half.gguf", data[: len(data) // 2]),
        ("header.gguf", data[:100]),
        ("empty.gguf", b""),
        ("junk.gguf", b"not a gguf file at all" * 10),
    ]:
        bad = tmp_path / name
        bad.write_bytes(blob)
        line = error_line(capsys, bad)
        assert name in line and "not a readable GGUF file, or truncated" in line, line
    assert "no such file" in error_line(capsys, tmp_path / "missing.gguf")


def test_wrong_architecture(q4, tmp_path, capsys):
    hf_dir, _, _ = q4
    write_gguf(hf_dir, tmp_path / "m.gguf", arch="gemma3")
    line = error_line(capsys, tmp_path / "m.gguf")
    assert "architecture 'gemma3' is not supported" in line


def test_tensor_shape_disagrees_with_metadata(q4, tmp_path, capsys):
    hf_dir, _, _ = q4
    bad = {"blk.2.attn_q_norm.weight": np.ones(16, np.float32)}  # a full layer: head_dim 32
    write_gguf(hf_dir, tmp_path / "m.gguf", replace=bad)
    line = error_line(capsys, tmp_path / "m.gguf")
    assert "'blk.2.attn_q_norm.weight'" in line and "shape [16]" in line and "[32]" in line


def test_unsupported_quant_type(q4, tmp_path, capsys):
    hf_dir, _, _ = q4
    write_gguf(hf_dir, tmp_path / "m.gguf", types={"blk.1.attn_q.weight": T.Q4_1})
    line = error_line(capsys, tmp_path / "m.gguf")
    assert "'blk.1.attn_q.weight' is Q4_1" in line and "Q4_0" in line


def test_missing_key_and_missing_tensor(q4, tmp_path, capsys):
    hf_dir, _, _ = q4
    write_gguf(hf_dir, tmp_path / "a.gguf", drop_keys=("gemma4.attention.sliding_window",))
    assert "no 'gemma4.attention.sliding_window'" in error_line(capsys, tmp_path / "a.gguf")
    write_gguf(hf_dir, tmp_path / "b.gguf", drop_keys=("gemma4.attention.key_length_swa",))
    assert "no 'gemma4.attention.key_length_swa'" in error_line(capsys, tmp_path / "b.gguf")


def test_store_layers_must_sit_before_the_shared_block(tmp_path):
    hf_dir = tmp_path / "hf"
    build_hf(hf_dir, num_hidden_layers=7, layer_types=layer_types(2, 7), num_kv_shared_layers=3)
    write_gguf(hf_dir, tmp_path / "m.gguf")  # S S F S | S F F: llama.cpp would reuse 2 and 3
    with pytest.raises(EdgeMTPError, match="would reuse layer 2 in llama.cpp but layer 3"):
        GGUFSource(tmp_path / "m.gguf")

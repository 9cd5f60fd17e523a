"""The reference engine's int8 KV cache (`--kv-cache int8`): the stored form against numpy, and
the engine over it against a float engine whose cache holds the same rounded values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle_int8 import numpy_int8, numpy_int8_rows

from edgemtp.cli import main
from edgemtp.export.forms import form_for
from edgemtp.export.weights import attach_int4
from edgemtp.model.cache import KVCache, cache_bytes
from edgemtp.model.embedded import ASSISTANT, PROMPTS, TARGET
from edgemtp.model.primitives import Form, Primitives, quantize_kv, read_rows, stored_rows
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.backends import ReferenceBackend
from edgemtp.runtime.generate import FixedDepth, decode, generate
from edgemtp.runtime.session import Session
from edgemtp.runtime.tokenizer import load_tokenizer


def test_quantize_kv_matches_numpy():
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0)) * 5
    x[1, 7] = 0  # an all-zero row: scale 0, codes 0
    codes, scale = quantize_kv(x)
    want_codes, want_scale = numpy_int8(x.numpy())
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    assert codes.dtype == torch.int8 and scale.shape == (3, 40, 1)
    assert int(codes.abs().max()) == 127 and not codes[1, 7].any()
    error = (codes.float() * scale - x).abs()
    assert bool((error <= scale / 2 * (1 + 1e-6)).all())  # within half a step everywhere
    # stored: each row's codes, then its scale's bytes; read back as codes * scale
    stored = stored_rows(x, torch.int8)
    assert stored.shape == (3, 40, 68)
    np.testing.assert_array_equal(stored.numpy(), numpy_int8_rows(x.numpy()))
    assert torch.equal(read_rows(stored, torch.float32), codes.float() * scale)


def _numpy_rounded(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.multiply(*numpy_int8(t.float().numpy()), dtype=np.float32))


class RoundedFloatCache(KVCache):
    """A float32 cache that stores what numpy's int8 rounding gives back: the oracle."""

    def write(self, new_kv, start):
        rounded = {layer: tuple(map(_numpy_rounded, pair)) for layer, pair in new_kv.items()}
        super().write(rounded, start)


class RoundedOwnRows(Primitives):
    """The reference, a call's own new rows attended as numpy's int8 rounding gives them back
    (as an int8 cache will: a verify row sees what a later step reads)."""

    def extend(self, past, new):
        return (torch.cat([*past, _numpy_rounded(new)], dim=1),)


@pytest.fixture(scope="module")
def pair(tiny_q4_0_pair):
    target = load_target(tiny_q4_0_pair[0])
    return target, load_drafter(tiny_q4_0_pair[1], target.cfg)


def _prompt(n: int = 27) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def test_int8_cache_reads_back_its_rounding(pair):
    target, _ = pair
    cache = KVCache(target.cfg, 48, 2, torch.int8)
    oracle = RoundedFloatCache(target.cfg, 48, 2)
    gen = torch.Generator().manual_seed(2)
    start = 0
    for n in (20, 9, 1, 15):  # past the sliding ring: slots are reused
        rows = {
            i: tuple(torch.randn(k.shape[0], n, k.shape[2] - 4, generator=gen) for _ in "kv")
            for i, k in cache.k.items()
        }
        cache.write(rows, start)
        oracle.write(rows, start)
        start += n
    for layer in cache.k:
        (k,), (v,) = cache.kv(layer)
        (ok,), (ov,) = oracle.kv(layer)
        assert torch.equal(read_rows(k, torch.float32), ok)
        assert torch.equal(read_rows(v, torch.float32), ov)
    fp16 = KVCache(target.cfg, 48, 2, torch.float16)
    assert cache.k[0].dtype == torch.int8
    # per token and KV head: head_dim int8 codes and a float32 scale, for K and for V
    heads_slots_dim = [k.shape for k in fp16.k.values()]
    assert cache.row_bytes() == sum(2 * h * (d + 4) for h, _, d in heads_slots_dim)
    assert cache.nbytes() == sum(2 * h * n * (d + 4) for h, n, d in heads_slots_dim)
    assert fp16.nbytes() == sum(2 * h * n * d * 2 for h, n, d in heads_slots_dim)
    for itemsize, dtype in ((1, torch.int8), (2, torch.float16)):
        want = KVCache(target.cfg, 48, 2, dtype).nbytes()
        assert cache_bytes(target.cfg, 48, 2, itemsize) == want


def test_int8_engine_equals_a_float_engine_over_the_rounded_cache(pair):
    """Prefill, AR decode and MTP rounds over the int8 cache decode exactly what the float
    engine does when its cache holds numpy's rounding of the same rows: the engine reads the
    cache it wrote, the drafter included, and nothing else."""
    target, drafter = pair
    prompt = _prompt()
    got = generate(target, prompt, 24, prefill_chunk=8, kv_cache="int8")
    backend = ReferenceBackend(target, max_context=64, prefill_chunk=8)
    backend.cache = RoundedFloatCache(target.cfg, 64, 0)
    backend.form = Form("numpy-int8", RoundedOwnRows(), RoundedOwnRows())
    want = decode(backend, prompt, 24, policy=FixedDepth(0))
    assert got.tokens == want.tokens
    fp32 = generate(target, prompt, 24, prefill_chunk=8)
    assert fp32.tokens[:2] == got.tokens[:2]  # close to the float cache's (a random model)
    for depth in (1, 2):
        mtp = generate(
            target, prompt, 24, drafter=drafter, mtp_depth=depth, prefill_chunk=8,
            kv_cache="int8",
        )  # fmt: skip
        assert mtp.tokens == got.tokens, depth  # greedy MTP is lossless over the int8 cache


def test_kv_cache_flag(tiny_q4_0_pair, tmp_path, capsys):
    model = str(tiny_q4_0_pair[0])
    args = ["generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json"]
    assert main([*args, "--model", model, "--kv-cache", "int8", "--mtp", "0"]) == 0
    assert '"kv_cache": "int8"' in capsys.readouterr().out
    assert main([*args, "--bundle", str(tmp_path), "--kv-cache", "int8"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--kv-cache is for --model; a bundle carries its own")
    )


# --- bundles: ExecuTorch cpu with edgemtp's kernels keeps int8 K/V ------------------------------


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory) -> Path:
    """The embedded pair exported with `--kv-cache int8` (Q4_0, ExecuTorch cpu, edgemtp's
    kernels): a trained pair, whose greedy picks are not near-ties at every step."""
    out = tmp_path_factory.mktemp("int8-kv") / "bundle"
    argv = ["export", "--model", str(TARGET), "--drafter", str(ASSISTANT), "--quant", "q4_0"]
    argv += ["--backend", "executorch", "--delegate", "cpu", "--max-context", "256"]
    assert main([*argv, "--kv-cache", "int8", "--out", str(out)]) == 0
    return out


def test_int8_bundle_decodes_the_reference_engines_tokens(int8_bundle, tmp_path):
    """The bundle's programs keep int8 rows (codes, then a float32 scale) and read them in
    place: greedy AR equals, token for token, the reference engine computing the program's
    numerics over its own int8 cache; MTP equals AR, the drafter reading the same cache."""
    manifest = json.loads((int8_bundle / "manifest.json").read_text())
    assert manifest["numerics"]["kv_cache"].startswith("int8 K/V")
    cfg = load_target(TARGET).cfg
    kv = [b for b in manifest["cache"]["buffers"] if b["name"][0] in "kv"]
    assert kv and all(b["dtype"] == "int8" for b in kv)
    assert {b["shape"][2] for b in kv} == {s.head_dim + 4 for s in cfg.layers if s.owns_kv}
    session = Session.from_bundle(int8_bundle, verify=False)
    assert session.info["kv_cache"] == "int8"
    elements = sum(math.prod(b["shape"]) for b in kv)  # int8: one byte each
    assert session.info["kv_cache_bytes"] == elements
    half = sum(2 * b["shape"][0] * b["shape"][1] * (b["shape"][2] - 4) for b in kv)
    assert elements / half < 0.53  # about half float16's bytes (head dims 64+: 4 bytes a scale)

    settings = Settings(scheme="q4_0", group_size=32)
    for role, path in (("target", TARGET), ("assistant", ASSISTANT)):
        quantize_checkpoint(path, tmp_path / role, settings)  # as the export quantized them
    target = load_target(tmp_path / "target")
    drafter = load_drafter(tmp_path / "assistant", target.cfg)
    form = form_for("executorch", "cpu", "edgemtp", "int8")
    for model in (target, drafter):
        attach_int4(model.model, model.source, model.names)
        model.use_form(form)
    reference = Session(
        ReferenceBackend(target, drafter, max_context=256, prefill_chunk=128, kv_cache="int8")
    )
    tokenizer = load_tokenizer(TARGET)
    for text in json.loads(PROMPTS.read_text())[:2]:
        ids = tokenizer.encode_prompt(text)
        want = reference.generate(ids, 32, mtp=0, stop_ids=())
        reference.reset()
        got = session.generate(ids, 32, mtp=0, stop_ids=())
        session.reset()
        assert got.tokens == want.tokens
        mtp = session.generate(ids, 32, mtp=3, stop_ids=())
        session.reset()
        assert mtp.tokens == got.tokens
        # drafts from the int8 cache the target wrote (over an empty one they would miss)
        assert mtp.metrics()["acceptance_rate"] > 0.5


def test_generate_model_in_the_bundles_numerics_gives_its_tokens(int8_bundle, tmp_path, capsys):
    """`generate --model ... --kv-cache int8 --numerics executorch` over the checkpoints the
    export quantized: the int8 bundle's greedy tokens, AR and MTP."""
    quantized = []
    for role, path in (("target", TARGET), ("assistant", ASSISTANT)):
        out = tmp_path / role
        assert main(["quantize", "--model", str(path), "--scheme", "q4_0", "--out", str(out)]) == 0
        quantized.append(out)
    tokenizer = load_tokenizer(TARGET)

    def tokens(ids: list[int], *source: str, mtp: int) -> list[int]:
        capsys.readouterr()
        argv = ["generate", *source, "--prompt-ids", ",".join(map(str, ids)), "--json"]
        assert main([*argv, "--max-new-tokens", "32", "--mtp", str(mtp), "--ignore-eos"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]

    model = ["--model", str(quantized[0]), "--drafter", str(quantized[1]), "--kv-cache", "int8"]
    model += ["--numerics", "executorch"]
    for text in json.loads(PROMPTS.read_text())[:2]:
        ids = tokenizer.encode_prompt(text)
        bundle = tokens(ids, "--bundle", str(int8_bundle), mtp=0)
        assert tokens(ids, *model, mtp=0) == bundle
        assert tokens(ids, *model, mtp=3) == bundle


def test_numerics_executorch_wants_4bit_checkpoints(capsys):
    argv = ["generate", "--model", str(TARGET), "--numerics", "executorch", "--prompt-ids", "2"]
    assert main([*argv, "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "quantize it first" in err


@pytest.mark.parametrize(
    ("flags", "reads"),
    [
        (["--backend", "onnx"], "fp32"),
        (["--backend", "executorch", "--kernels", "xnnpack"], "fp32"),
    ],
)
def test_a_bundle_whose_attention_takes_float_kv_refuses_int8(
    tiny_q4_0_pair, tmp_path, capsys, flags, reads
):
    out = tmp_path / "bundle"
    argv = ["export", "--model", str(tiny_q4_0_pair[0]), *flags, "--delegate", "cpu"]
    assert main([*argv, "--kv-cache", "int8", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reads its cache as fp32 only" in err
    assert "--kernels edgemtp" in err and not out.exists()

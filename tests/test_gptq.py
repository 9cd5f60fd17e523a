"""GPTQ W4A16: lower output error than round-to-nearest, same format, and calibration Hessians."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.model.checkpoint import Target
from edgemtp.model.synth import write_preset
from edgemtp.quantize.gptq import collect_hessians, gptq_quantize
from edgemtp.quantize.load import load_target
from edgemtp.quantize.w4a16 import (
    W4A16,
    dequantize_w4a16,
    quantize_w4a16,
    read_pack_quantized,
    to_pack_quantized,
)
from edgemtp.quantize.w4a16 import W4A16Scheme as Scheme


def _layer(out: int, cols: int, rows: int = 2048, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A random weight and correlated calibration inputs X = Z·A with a few loud channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.02
    mix = torch.eye(cols) + torch.randn(cols, cols, generator=g) / cols**0.5
    z = torch.randn(rows, cols, generator=g)
    z[:, torch.randperm(cols, generator=g)[:4]] *= 10.0
    return w, z @ mix


def _hessian(x: Tensor) -> Tensor:
    return 2.0 * x.T.double() @ x.double() / x.shape[0]


def _output_error(x: Tensor, w: Tensor, q: W4A16) -> float:
    return float(((x.double() @ (w.double() - dequantize_w4a16(q).double()).T) ** 2).sum())


def _check_valid(q: W4A16, shape: tuple[int, int], group: int, symmetric: bool, dtype) -> None:
    lo, hi = (-8, 7) if symmetric else (0, 15)
    assert q.shape == shape and q.codes.dtype == torch.int8
    assert int(q.codes.min()) >= lo and int(q.codes.max()) <= hi
    assert q.scales.dtype == dtype and q.scales.shape == (shape[0], shape[1] // group)
    assert bool(torch.isfinite(q.scales).all()) and bool((q.scales > 0).all())
    assert q.group_size == group and q.symmetric == symmetric
    if symmetric:
        assert q.zero_points is None
    else:
        assert q.zero_points is not None and q.zero_points.shape == q.scales.shape
        assert int(q.zero_points.min()) >= 0 and int(q.zero_points.max()) <= 15
    # the pack-quantized layout carries it unchanged
    back = read_pack_quantized(to_pack_quantized(q), Scheme(group, symmetric))
    assert torch.equal(dequantize_w4a16(back), dequantize_w4a16(q))


# --- GPTQ on one layer -------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_beats_round_to_nearest(symmetric: bool, group: int):
    w, x = _layer(96, 256)
    h = _hessian(x)
    q = gptq_quantize(w, h, group, symmetric, torch.bfloat16)
    _check_valid(q, (96, 256), group, symmetric, torch.bfloat16)
    rtn = quantize_w4a16(w, group, symmetric, torch.bfloat16)
    ratio = _output_error(x, w, q) / _output_error(x, w, rtn)
    assert ratio < 0.8, ratio  # measured 0.24-0.26


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_beats_round_to_nearest(symmetric: bool):
    w, x = _layer(64, 256, seed=1)
    q = gptq_quantize(w, _hessian(x), 64, symmetric, torch.float16, act_order=True)
    _check_valid(q, (64, 256), 64, symmetric, torch.float16)
    rtn = quantize_w4a16(w, 64, symmetric, torch.float16)
    # act order keeps round-to-nearest's (static) group scales
    assert torch.equal(q.scales, rtn.scales)
    assert _output_error(x, w, q) < 0.8 * _output_error(x, w, rtn)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    ("w_dtype", "scale_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("act_order", [False, True])
def test_uncorrelated_hessian_is_round_to_nearest(symmetric, w_dtype, scale_dtype, act_order):
    """H = c·I (any dampening): no error is fed back, so GPTQ rounds exactly as RTN does."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(48, 128, generator=g) * torch.logspace(-3, 0, 48)[:, None]).to(w_dtype)
    w[0] = 0  # an all-zero row (eps scale)
    w[2] = (torch.arange(128).remainder(31).sub(15) * 0.25).to(w_dtype)  # exact .5 ties
    rtn = quantize_w4a16(w, 32, symmetric, scale_dtype)
    q = gptq_quantize(w, 3.0 * torch.eye(128), 32, symmetric, scale_dtype, act_order=act_order)
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.scales, rtn.scales)
    if not symmetric:
        assert torch.equal(q.zero_points, rtn.zero_points)


def _naive_gptq(w: Tensor, h: Tensor, group: int, symmetric: bool, damp: float = 0.01) -> W4A16:
    """The algorithm without lazy blocks: every column's error updates all later columns at once,
    group parameters from round-to-nearest on the current weights when a group is entered."""
    w = w.clone().float()
    h = h.double().clone()
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales, zps = [], []
    for c in range(w.shape[1]):
        if c % group == 0:
            rtn = quantize_w4a16(w[:, c : c + group], group, symmetric, torch.bfloat16)
            scales.append(rtn.scales)
            zps.append(rtn.zero_points)
            s = rtn.scales[:, 0].float()
            z = torch.zeros_like(s) if symmetric else rtn.zero_points[:, 0].float() - 8
        q = (w[:, c] / s + z).clamp(-8, 7).round()
        codes[:, c] = (q if symmetric else q + 8).to(torch.int8)
        err = (w[:, c] - (q - z) * s) / hinv[c, c]
        w[:, c:] -= err[:, None] * hinv[c, c:][None, :]
    zp = None if symmetric else torch.cat(zps, dim=1)
    return W4A16(codes, torch.cat(scales, dim=1), zp, group, symmetric)


@pytest.mark.parametrize("symmetric", [True, False])
def test_lazy_blocks_match_the_plain_algorithm(symmetric: bool):
    w, x = _layer(64, 256, seed=3)
    h = _hessian(x)
    want = _naive_gptq(w, h, 32, symmetric)
    for block in (32, 100, 128, 512):  # rounded up to whole groups
        got = gptq_quantize(w, h, 32, symmetric, block_size=block)
        # float32 updates in another order may flip a rare near-tie, nothing more
        assert (got.codes != want.codes).float().mean() < 2e-3, block
        torch.testing.assert_close(dequantize_w4a16(got), dequantize_w4a16(want), atol=0.02, rtol=0)


def test_dead_inputs_quantize_to_zero():
    w, x = _layer(32, 128, seed=4)
    x[:, [5, 70]] = 0.0
    q = gptq_quantize(w, _hessian(x), 32, symmetric=False)
    _check_valid(q, (32, 128), 32, False, torch.bfloat16)
    assert bool((dequantize_w4a16(q)[:, [5, 70]] == 0).all())


def test_gptq_rejects_bad_inputs():
    w = torch.randn(8, 64)
    with pytest.raises(EdgeMTPError, match="Hessian has shape"):
        gptq_quantize(w, torch.eye(32), 32)
    with pytest.raises(EdgeMTPError, match="NaN"):
        gptq_quantize(w, torch.full((64, 64), float("nan")), 32)
    with pytest.raises(EdgeMTPError, match="multiple of group size"):
        gptq_quantize(w, torch.eye(64), 48)
    with pytest.raises(EdgeMTPError, match="scale dtype"):
        gptq_quantize(w, torch.eye(64), 32, scale_dtype=torch.int8)
    with pytest.raises(EdgeMTPError, match="not positive definite"):
        gptq_quantize(w, -torch.eye(64), 32)


# --- calibration Hessians on a tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Target:
    root: Path = tmp_path_factory.mktemp("gptq")
    return load_target(write_preset("tiny", root / "t", dtype="float32"))


def _calibration(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (21, 0, 13)]


def _inputs_by_hand(target: Target, seqs: list[list[int]], names: list[str]) -> dict[str, Tensor]:
    """Each layer's inputs from one whole-sequence forward per sequence ("lm_head": the output)."""
    got: dict[str, list[Tensor]] = {n: [] for n in names}
    modules = dict(target.model.named_modules())
    hooks = [
        modules[n].register_forward_pre_hook(lambda _m, a, n=n: got[n].append(a[0].clone()))
        for n in names
        if n != "lm_head"
    ]
    try:
        for seq in filter(None, seqs):
            ids = torch.tensor(seq)
            hidden, _ = target.model(
                target.tables.embed(ids),
                target.tables.per_layer_inputs(ids),
                torch.arange(len(seq)),
                KVCache(target.cfg, len(seq)),
                "all",
            )
            if "lm_head" in got:
                got["lm_head"].append(hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return {n: torch.cat(xs) for n, xs in got.items()}


def test_collect_hessians_covers_every_linear_layer(tiny: Target):
    seqs = _calibration(tiny.cfg.vocab_size)
    messages: list[str] = []
    hessians = collect_hessians(tiny, seqs, progress=messages.append, chunk=8)
    linears = {n: m for n, m in tiny.model.named_modules() if isinstance(m, nn.Linear)}
    assert set(hessians) == set(linears)  # every linear runs with rows="all", lm_head included
    assert len(messages) == 2  # the empty sequence is skipped
    # KV-shared layers own no k/v projections, hence no Hessians for them
    for spec in tiny.cfg.layers:
        has_kv = f"layers.{spec.index}.self_attn.k_proj" in hessians
        assert has_kv == spec.owns_kv
    for name, h in hessians.items():
        cols = linears[name].in_features
        assert h.shape == (cols, cols) and h.dtype == torch.float32
        torch.testing.assert_close(h, h.T)
        assert float(torch.linalg.eigvalsh(h.double()).min()) > -1e-5 * float(h.diagonal().max())

    names = ["layers.3.mlp.down_proj", "layers.7.self_attn.q_proj", "lm_head"]
    xs = _inputs_by_hand(tiny, seqs, names)
    for name in names:
        x = xs[name].double()
        want = 2.0 * x.T @ x / x.shape[0]  # by hand, from unchunked forwards
        tol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(hessians[name].double(), want, rtol=1e-4, atol=tol)

    # a subset, accumulated in float64, gives the same matrices
    subset = collect_hessians(tiny, seqs, names, dtype=torch.float64)
    assert set(subset) == set(names)
    for name in names:
        assert subset[name].dtype == torch.float64
        tol = 1e-5 * float(hessians[name].abs().max())
        torch.testing.assert_close(subset[name].float(), hessians[name], rtol=1e-4, atol=tol)

    # GPTQ with these Hessians beats round-to-nearest on the calibration activations
    x = xs["layers.3.mlp.down_proj"]
    w = linears["layers.3.mlp.down_proj"].weight
    q = gptq_quantize(w, hessians["layers.3.mlp.down_proj"], 32, symmetric=True)
    assert _output_error(x, w, q) < 0.9 * _output_error(x, w, quantize_w4a16(w, 32))


def test_collect_hessians_rejects_bad_requests(tiny: Target):
    with pytest.raises(EdgeMTPError, match="not nn.Linear"):
        collect_hessians(tiny, [[1, 2, 3]], ["layers.0.mlp", "layers.5.self_attn.k_proj"])
    with pytest.raises(EdgeMTPError, match="non-empty"):
        collect_hessians(tiny, [[]])

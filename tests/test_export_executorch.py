"""ExecuTorch backend: lowered programs against the reference engine and a numpy oracle of 8da4w.

Fast (always): the 8da4w building blocks. XNNPACK's int8 row quantization reproduced bit for
bit; one 8da4w linear per scheme (Q4_0 with negative scales, W4A16, asymmetric W4A16) against an
independent numpy oracle; the block form equals the checkpoint's weights; deterministic bytes;
the QNN error without the SDK.

Whole bundles: one program per scheme shared by the tests, Q4_0 always, fp32 and W4A16 with
EDGEMTP_SLOW_TESTS=1 (ExecuTorch lowers a tiny bundle in ~6 min on a 2-core host). fp32: greedy
tokens equal `runtime.generate.generate`, AR and MTP depth 2. 8da4w: exact equality of free-running
tokens is ill-posed on a random tiny model (a 1e-7 relative change of the activations moves its
logits by ~1.5% through int8 rounding flips, more than many top-2 gaps), so the program's MTP
tokens (every depth, adaptive, and known drafts partly rejected: cache rollback) must be what its
own AR method picks when fed them, but at near-ties; its AR tokens, teacher-forced, must match
the eager reference of the program's numerics but at near-ties; and the logits must stay within
the stated tolerances of the eager references.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from oracle_drafts import OracleDrafts, WholeCacheCheck, greedy

from edgemtp.devices.calibrate.xnnpack import linear_chain
from edgemtp.errors import EdgeMTPError
from edgemtp.export.executorch import PORTABLE_CALL, lower_executorch, program_operator_kinds
from edgemtp.export.executorch_program import (
    backend_config,
    delegation_summary,
    export_method,
    lower_programs,
    xnnpack_partitioner,
)
from edgemtp.export.forms import XNNPACK_KERNELS
from edgemtp.export.int4 import QKV, Int4Linear, _block_form, fuse_linears, xnnpack_int8_rows
from edgemtp.export.primitives import projections
from edgemtp.export.weights import attach_int4, int4_of
from edgemtp.model.cache import KVCache
from edgemtp.model.forward import forward_rows, prefill
from edgemtp.model.primitives import REFERENCE
from edgemtp.model.static import StaticBundle, StaticShapes
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.generate import generate
from edgemtp.runtime.runners.executorch import ExecuTorchRunner
from edgemtp.runtime.session import Session

SHAPES = StaticShapes(max_context=64, max_draft=4, chunk=8)
N_NEW = 36  # tiny's window is 16: decoding runs past it
# q4_0 always (one tiny bundle: ~6 min of ExecuTorch lowering on a 2-core host); the others slow
SCHEMES = ("q4_0", "none", "w4a16")
# max |program logit - reference logit| / max |reference logit|, prefill of 13 tokens.
# fp32 program vs fp32 reference: float rounding. 8da4w program vs the fp32-activation reference
# on the same dequantized weights: int8 activations (~0.5% per linear) through 85 linears of a
# random model, measured ~20%. 8da4w program vs the eager 8da4w reference (same int8 rounding):
# float-rounding differences flip a few int8 codes, measured ~2%.
TOLERANCE = {"fp32": 1e-4, "8da4w_vs_fp32": 0.35, "8da4w_vs_8da4w": 0.05}
slow = pytest.mark.skipif(
    not os.environ.get("EDGEMTP_SLOW_TESTS"),
    reason="lowering a whole tiny bundle takes minutes per scheme here; set EDGEMTP_SLOW_TESTS=1",
)
BUNDLE_SCHEMES = [s if s == "q4_0" else pytest.param(s, marks=slow) for s in SCHEMES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("et")
    write_preset("tiny", root / "none_t", init_std=0.05)
    write_preset("tiny-assistant", root / "none_a", init_std=0.05)
    for scheme, kw in (("q4_0", {}), ("w4a16", {}), ("w4a16_asym", {"symmetric": False})):
        for role in ("t", "a"):
            settings = Settings(scheme=scheme.removesuffix("_asym"), **kw)
            quantize_checkpoint(root / f"none_{role}", root / f"{scheme}_{role}", settings)
    return root


def _load(root, scheme: str, program_numerics: bool = False):
    """Target and drafter of a scheme with their 4-bit forms attached; `program_numerics`:
    in the form the XNNPACK program computes (8da4w linears, edgemtp's kernels), in eager."""
    target = load_target(root / f"{scheme}_t")
    drafter = load_drafter(root / f"{scheme}_a", target.cfg)
    for loaded in (target, drafter):
        if scheme != "none":
            attach_int4(loaded.model, loaded.source, loaded.names)
        if program_numerics:
            loaded.use_form(XNNPACK_KERNELS)
    return target, drafter


def _prompt(n: int = 21, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(program: bytes, x: torch.Tensor) -> np.ndarray:
    from executorch.runtime import Runtime

    return Runtime.get().load_program(program).load_method("forward").execute([x])[0].numpy()


def _lower_linear(linear: torch.nn.Module, x: torch.Tensor) -> bytes:
    edge = lower_programs({"forward": export_method(linear, (x,))}, lambda: [xnnpack_partitioner()])
    return edge.to_executorch(backend_config()).buffer


# --- 8da4w building blocks -------------------------------------------------------------------


def program_operators(program) -> dict[str, int]:
    """Operators each method of a program dispatches per call, of every kind."""
    return {name: sum(kinds.values()) for name, kinds in program_operator_kinds(program).items()}


def _xnnpack_qd8(x: np.ndarray) -> np.ndarray:
    """Numpy oracle of XNNPACK's dynamic int8 quantization of one row, dequantized: range
    [min(x, 0), max(x, 0)], scale = range / 255, zero point as XNNPACK's quantization.h (from
    the end with the smaller error, clamped, rounded), q = round(x * (255 / range)) + zero."""
    lo, hi = min(np.float32(0), x.min()), max(np.float32(0), x.max())
    if lo == hi:
        return np.zeros_like(x)
    scale = np.float32((hi - lo) / np.float32(255))
    inv = np.float32(np.float32(255) / np.float32(hi - lo))
    lo_s, hi_s = np.float32(lo / scale), np.float32(hi / scale)
    from_min = np.float32(np.float32(-128) + lo_s) + np.float32(np.float32(127) + hi_s) > 0
    zero = np.float32(-128) - lo_s if from_min else np.float32(127) - hi_s
    zero = np.float32(np.rint(np.clip(zero, -128, 127)))
    q = np.clip(np.rint(np.float32(x * inv)) + zero, -128, 127)
    return ((q - zero) * scale).astype(np.float32)


def test_int8_row_quantization_is_xnnpacks_bit_for_bit():
    """An identity 8da4w linear (codes 1, scales 1) returns XNNPACK's dequantized int8 rows."""
    n, rows = 64, 3000
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x = x + 0.3 * torch.randn(rows, 1, generator=g)
    identity = Int4Linear(torch.eye(n), torch.ones(n, 2), torch.zeros(n, 2), group=32)
    got = _run(_lower_linear(identity, x), x)
    oracle = np.stack([_xnnpack_qd8(row) for row in x.numpy()])
    # the same int8 code everywhere: differences far below one quantization step per row
    xn = x.numpy()
    step = (np.maximum(xn.max(1), 0) - np.minimum(xn.min(1), 0))[:, None] / 255
    assert (np.abs(got - oracle) < 0.01 * step).all()
    assert np.array_equal(xnnpack_int8_rows(x).numpy(), oracle)  # the eager reference's
    with torch.no_grad():
        assert (np.abs(identity(x).numpy() - got) < 0.01 * step).all()


@pytest.mark.parametrize("scheme", ["q4_0", "w4a16", "w4a16_asym"])
def test_8da4w_linear_matches_numpy_oracle(checkpoints, scheme):
    target, _ = _load(checkpoints, scheme)
    w = int4_of(target.model.layers[0].mlp.down_proj)
    codes, scales, offset = _block_form(w)
    if scheme == "q4_0":
        assert (w.scales < 0).any() and offset is not None  # negative blocks: offset path
    if scheme == "w4a16":
        assert offset is None
    # the block form is the checkpoint's weight, exactly
    blocks = codes.float().view(*scales.shape, -1) * scales[..., None]
    extra = 0 if offset is None else offset.repeat_interleave(w.group, 1)
    assert torch.equal(blocks.view(w.shape) + extra, w.dequantize())

    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1)) * 1.5
    got = _run(_lower_linear(Int4Linear.xnnpack(w), x), x)
    # oracle: XNNPACK-quantized rows times the codes with bf16 block scales, plus the block
    # offsets times the block sums of the float rows
    bf16 = scales.bfloat16().float().numpy()
    weight = codes.numpy().astype(np.float32).reshape(*bf16.shape, -1) * bf16[..., None]
    xn = x.numpy()
    oracle = np.stack([_xnnpack_qd8(row) for row in xn]) @ weight.reshape(w.shape).T
    if offset is not None:
        oracle += xn.reshape(5, -1, w.group).sum(-1) @ offset.numpy().T
    scale = np.abs(oracle).max()
    assert np.abs(got - oracle).max() <= 2e-6 * scale
    assert np.abs(oracle - xn @ w.dequantize().numpy().T).max() > 1e-4 * scale  # not fp32


def test_block_form_of_a_weight_taller_than_a_conversion_chunk_is_exact():
    """`_block_form` converts a few thousand rows at a time: every chunk, the last partial one
    too, holds the weight exactly (zero, negative and positive scales, asymmetric zeros)."""
    from edgemtp.export.int4 import _FORM_ROWS
    from edgemtp.export.weights import Int4Weight

    g = torch.Generator().manual_seed(3)
    rows, cols, group = 2 * _FORM_ROWS + 77, 64, 32
    # float16 values, as checkpoints store them: a code times a scale is then exact in fp32
    scales = torch.randn(rows, cols // group, generator=g).half().float()
    scales[::7] = 0.0
    w = Int4Weight(
        torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g),
        scales,
        torch.randint(0, 16, (rows, cols // group), dtype=torch.uint8, generator=g),
        group,
        "w4a16",
    )
    codes, block_scales, offset = _block_form(w)
    assert offset is not None and codes.dtype == torch.int8 and (block_scales > 0).all()
    blocks = codes.float().view(rows, -1, group) * block_scales[..., None]
    dequantized = blocks.view(rows, cols) + offset.repeat_interleave(group, 1)
    np.testing.assert_array_equal(dequantized.numpy(), w.dequantize().numpy())


class _ThreeParts(torch.nn.Module):
    """Q, K and V of a layer as an attention block projects them."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = projections(REFERENCE, self.attn, x, q=True, kv=True)
        return torch.cat([k, v, q], dim=-1)


def test_fused_qkv_linear_computes_each_part_exactly(checkpoints):
    """One 8da4w linear for Q, K and V: the program runs one int4 GEMM, and each part's
    columns are what that part's own lowered linear computes."""
    target, _ = _load(checkpoints, "q4_0")
    attn = target.model.layers[0].self_attn
    parts = {
        n: Int4Linear.xnnpack(int4_of(getattr(attn, n))) for n in ("k_proj", "v_proj", "q_proj")
    }
    for name, linear in parts.items():
        setattr(attn, name, linear)
    x = torch.randn(4, parts["q_proj"].in_features, generator=torch.Generator().manual_seed(2))
    separate = np.concatenate([_run(_lower_linear(p, x), x) for p in parts.values()], axis=-1)
    assert fuse_linears(attn, {"qkv": QKV}) == 3
    assert isinstance(attn.qkv, Int4Linear) and attn.qkv.offset is not None
    assert attn.q_proj is None and attn.qkv.widths == tuple(parts[n].out_features for n in QKV)
    module = _ThreeParts(attn)
    edge = lower_programs({"forward": export_method(module, (x,))}, lambda: [xnnpack_partitioner()])
    ops = program_operators(edge.to_executorch(backend_config()).executorch_program)["forward"]
    fused = _run(_lower_linear(module, x), x)
    scale = np.abs(separate).max()
    assert np.abs(fused - separate).max() <= 1e-6 * scale
    with torch.no_grad():
        assert np.abs(module(x).numpy() - separate).max() <= 0.05 * scale  # eager 8da4w form
    # one activation quantization + one int4 GEMM + one offset pair (FC, FC, add) + slices
    assert ops < 3 * 5


def test_lowering_a_program_twice_gives_the_same_bytes(checkpoints):
    target, _ = _load(checkpoints, "q4_0")
    linear = Int4Linear.xnnpack(int4_of(target.model.layers[0].mlp.down_proj))
    x = torch.randn(3, linear.in_features)
    assert _lower_linear(linear, x) == _lower_linear(linear, x)


def test_an_undelegated_linear_fails_the_lowering_naming_the_op():
    linear = torch.nn.Linear(32, 8, bias=False).requires_grad_(False)
    x = torch.randn(2, 32)
    delegated = lower_programs({"m": export_method(linear, (x,))}, lambda: [xnnpack_partitioner()])
    assert delegation_summary(delegated)["m"]["delegates"] == 1
    portable = lower_programs({"m": export_method(linear, (x,))}, None)
    with pytest.raises(
        EdgeMTPError, match=r"method m: aten\.mm\.default .* not delegated to XNNPACK"
    ):
        delegation_summary(portable)


def test_htp_without_qnn_sdk_names_the_sdk(checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    target, _ = _load(checkpoints, "none")
    bundle = StaticBundle.build(target.model, None, StaticShapes(64, 0, 8))
    with pytest.raises(EdgeMTPError) as e:
        lower_executorch(bundle, "htp", tmp_path, lambda _: None)
    assert str(e.value) == (
        "--delegate htp needs Qualcomm AI Engine Direct (QNN) SDK: install it and set "
        "QNN_SDK_ROOT (or use --delegate cpu)"
    )
    assert not list(tmp_path.iterdir())


def test_unknown_delegate_is_refused(checkpoints, tmp_path):
    target, _ = _load(checkpoints, "none")
    bundle = StaticBundle.build(target.model, None, StaticShapes(64, 0, 8))
    with pytest.raises(EdgeMTPError, match="no 'gpu' delegate"):
        lower_executorch(bundle, "gpu", tmp_path, lambda _: None)


# --- whole bundles ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lowered(checkpoints, tmp_path_factory):
    """scheme -> (program path, Lowered), lowered once per module."""
    cache: dict[str, tuple] = {}

    def get(scheme: str):
        if scheme not in cache:
            target, drafter = _load(checkpoints, scheme)
            bundle = StaticBundle.build(target.model, drafter.model, SHAPES)
            out = tmp_path_factory.mktemp(scheme)
            result = lower_executorch(bundle, "cpu", out, lambda _: None)
            cache[scheme] = (out / result.program, result)
        return cache[scheme]

    return get


@pytest.mark.parametrize("scheme", BUNDLE_SCHEMES)
def test_program_tokens(checkpoints, lowered, scheme):
    pte, _ = lowered(scheme)
    target, drafter = _load(checkpoints, scheme)
    runner = ExecuTorchRunner(pte, SHAPES)
    driver = StaticBackend(runner, target.tables, target.cfg)
    ar = greedy(driver, _prompt(), N_NEW, 0)

    def lossless(tokens: list[int], label: object) -> None:
        if scheme == "none":
            assert tokens == ar.tokens, label
        else:  # verify_4 and verify_0 round differently (see _program_picks)
            agree, gap = _program_picks(driver, _prompt(), tokens)
            # near-ties only: every pick within the tolerance of the program's best; how many
            # flip depends on the kernel variant's summation order (3 of 36 with AVX2's)
            assert agree >= N_NEW - 3 and gap <= TOLERANCE["8da4w_vs_8da4w"], (label, agree, gap)

    for depth in range(1, SHAPES.max_draft + 1):  # 1..3 left-padded into verify_4
        mtp = greedy(driver, _prompt(), N_NEW, depth)
        assert mtp.calls["draft_step"] > 0
        lossless(mtp.tokens, depth)
    mtp = greedy(driver, _prompt(), N_NEW, 2)
    lossless(Session(driver).generate(_prompt(), N_NEW, stop_ids=()).tokens, "adaptive")
    oracle = OracleDrafts(
        runner, target.tables, target.cfg, ar_tokens=ar.tokens, prompt_len=len(_prompt())
    )
    rolled = greedy(oracle, _prompt(), N_NEW, 2)
    assert 0 < rolled.accepted < rolled.drafted
    lossless(rolled.tokens, "rollback")
    if scheme == "none":  # same numerics as the reference engine: same tokens
        for depth, got in ((0, ar), (2, mtp)):
            ref = generate(
                target, _prompt(), N_NEW, drafter=drafter, mtp_depth=depth, prefill_chunk=8
            )
            assert got.tokens == ref.tokens
            assert got.drafted == ref.metrics()["drafted"]
        return
    # 8da4w prompt chunks, Q4_0-kernel steps: teacher-forced on the program's tokens, the eager
    # reference computing the program's numerics picks the same token but at near-ties. With
    # the kernel's float16 cache a last-bit difference in a key can flip its rounding to
    # float16, and one in an activation a Q8_0 code (a scale per 32 values: more rounding edges
    # than one per row), so the two drift further (prompts of seeds 0-6: 26-30 of 36 equal,
    # misses within 19 % of the logit range; 28-35 and 15 % when steps ran 8da4w too); on
    # this prompt the fp32-activation reference on the same weights agrees less (24 of 36, a
    # gap of 37 %).
    agree = {}
    for name, program_numerics in (("8da4w", True), ("fp32", False)):
        reference, _ = _load(checkpoints, scheme, program_numerics=program_numerics)
        agree[name], gap = _teacher_forced(reference, _prompt(), ar.tokens)
        if name == "8da4w":
            assert agree[name] >= N_NEW - 10 and gap <= 0.2
    assert agree["fp32"] < agree["8da4w"]


def _program_picks(
    driver: StaticBackend, prompt: list[int], tokens: list[int]
) -> tuple[int, float]:
    """Fed prompt + tokens one at a time through the program's AR method (verify_0), how many
    of `tokens` it also picks greedily, and the largest gap between its best logit and the
    token's, relative to its logit range.

    MTP on an 8da4w program is lossless only up to near-ties: its verify_4 runs other XNNPACK
    GEMM micro-kernels than verify_0 (another float summation order in attention), and a 1e-7
    relative change of the activations flips int8 codes that move a random tiny model's logits
    by ~1.5%, more than many top-2 gaps. A broken rollback or cache instead picks tokens far
    from the program's choice."""
    driver.truncate(0)
    rows = [driver.prefill(prompt, 0)[1]]
    for i, token in enumerate(tokens[:-1]):
        rows.append(driver.verify([token], len(prompt) + i)[0][0])
    logits = torch.stack(rows)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.abs().amax(-1)
    return int((gap == 0).sum()), float(gap.max())


def _teacher_forced(target, prompt: list[int], tokens: list[int]) -> tuple[int, float]:
    """Fed prompt + tokens, how many of `tokens` the reference also picks greedily, and the
    largest gap between its best logit and the token's, relative to its logit range."""
    cache = KVCache(
        target.cfg, len(prompt) + len(tokens), SHAPES.max_draft, target.form.cache_dtype
    )
    _, logits = prefill(target, cache, torch.tensor(prompt), chunk=8)
    rows = [logits]
    for token in tokens[:-1]:  # each as a decode step, as the program's verify_0 ran it
        hidden = forward_rows(target, cache, torch.tensor([token]), "all")
        rows.append(target.model.logits(hidden[-1], target.form.step))
    logits = torch.stack(rows)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.abs().amax(-1)
    return int((gap == 0).sum()), float(gap.max())


def test_drafter_reads_the_targets_cache_in_place(checkpoints, lowered):
    """After the program's prefill, its draft step equals the reference drafter's on the
    reference cache, and differs from a draft step over an empty cache: the drafter reads the
    cache the target methods wrote (one shared buffer, nothing copied), not a stale copy."""
    pte, _ = lowered("q4_0")
    target, drafter = _load(checkpoints, "q4_0", program_numerics=True)
    runner = ExecuTorchRunner(pte, SHAPES)
    prompt = _prompt()
    hidden, logits = StaticBackend(runner, target.tables, target.cfg).prefill(prompt, 0)
    embed = target.tables.embed(logits.argmax()[None])[0]
    got, _, _ = runner.call("draft_step", embed, hidden, torch.tensor([len(prompt)]))
    cache = KVCache(target.cfg, SHAPES.max_context, SHAPES.max_draft, target.form.cache_dtype)
    prefill(target, cache, torch.tensor(prompt), chunk=8)
    empty = KVCache(target.cfg, SHAPES.max_context, SHAPES.max_draft)
    with torch.no_grad():  # the next hidden state: continuous, unlike the top-k clustered ids
        ref, _, _ = drafter.model(embed, hidden, len(prompt), cache, drafter.form.step)
        stale, _, _ = drafter.model(embed, hidden, len(prompt), empty, drafter.form.step)
    error = float((got - ref).abs().max() / ref.abs().max())
    assert error <= TOLERANCE["8da4w_vs_8da4w"]
    assert float((stale - ref).abs().max() / ref.abs().max()) > 10 * max(error, 1e-3)


@pytest.mark.parametrize("scheme", BUNDLE_SCHEMES)
def test_program_logits_within_tolerance_of_eager_references(checkpoints, lowered, scheme):
    pte, _ = lowered(scheme)
    prompt = torch.tensor(_prompt(13))
    references = {"fp32": _load(checkpoints, scheme)[0]}
    if scheme != "none":
        references = {
            "8da4w_vs_fp32": references["fp32"],
            "8da4w_vs_8da4w": _load(checkpoints, scheme, program_numerics=True)[0],
        }
    first = references[next(iter(references))]
    driver = StaticBackend(ExecuTorchRunner(pte, SHAPES), first.tables, first.cfg)
    _, got = driver.prefill(prompt.tolist(), 0)
    for name, model in references.items():
        cache = KVCache(model.cfg, SHAPES.max_context, SHAPES.max_draft, model.form.cache_dtype)
        _, ref = prefill(model, cache, prompt, chunk=8)
        error = float((got - ref).abs().max() / ref.abs().max())
        assert error <= TOLERANCE[name], name
        if name == "8da4w_vs_fp32":
            assert error > 1e-3  # the int8 activations are really there


@pytest.mark.parametrize("linears", [1, 7])
def test_runtime_operators_are_the_xnnpack_nodes_plus_portable_calls(linears):
    class ChainThenCumsum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chain = linear_chain(linears)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # XNNPACK has no cumulative sum: one portable kernel call
            return self.chain(x).cumsum(-1)

    x = torch.randn(1, 64)
    edge = lower_programs(
        {"m": export_method(ChainThenCumsum(), (x,))}, lambda: [xnnpack_partitioner()]
    )
    nodes = delegation_summary(edge)["m"]
    assert nodes["portable_ops"] == {"aten.cumsum.default": 1}
    assert nodes["portable_elements"] == 64  # the cumsum's [1, 64] output
    program = edge.to_executorch(backend_config()).executorch_program
    # one XNNPACK fully-connected node per linear, one cumsum kernel
    assert program_operators(program) == {"m": linears + 1}
    assert program_operator_kinds(program) == {
        "m": {"XNNFullyConnected": linears, PORTABLE_CALL: 1}
    }


def test_delegated_elements_count_what_other_nodes_than_linears_write():
    class LinearThenActivation(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.linear(x) * 2 + 1).tanh()

    x = torch.randn(4, 64)
    edge = lower_programs(
        {"m": export_method(LinearThenActivation(), (x,))}, lambda: [xnnpack_partitioner()]
    )
    nodes = delegation_summary(edge)["m"]
    assert nodes["delegated_elements"] == 3 * 4 * 64  # mul, add, tanh; not the linear
    assert nodes["float_linear_flops"] == 2 * 4 * 64 * 64


def test_float_linear_flops_count_the_offset_pair_not_the_int4_gemm(checkpoints):
    target, _ = _load(checkpoints, "q4_0")
    linear = Int4Linear.xnnpack(int4_of(target.model.layers[0].mlp.down_proj))
    assert linear.offset is not None
    rows, blocks = 3, linear.offset.shape[1]
    x = torch.randn(rows, linear.in_features)
    edge = lower_programs({"m": export_method(linear, (x,))}, lambda: [xnnpack_partitioner()])
    # block sums: a 1-output linear over [rows, blocks, 32]; offsets: [out, blocks]
    want = 2 * rows * blocks * 32 + 2 * rows * linear.out_features * blocks
    assert delegation_summary(edge)["m"]["float_linear_flops"] == want


def test_a_cache_write_counts_the_rows_it_writes_not_the_cache():
    class WriteRows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 64, 8))

        def forward(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(1, slots, rows)  # in place in the program
            return slots + 1

    rows, slots = torch.randn(1, 3, 8), torch.tensor([5, 6, 7])
    edge = lower_programs({"m": export_method(WriteRows(), (rows, slots))}, None)
    nodes = delegation_summary(edge)["m"]
    assert nodes["portable_ops"].get("aten.index_put.default") == 1
    # the 3 x 8 values written, and the 3 elements of slots + 1; not the 512 of the cache
    assert nodes["portable_elements"] == 3 * 8 + 3
    assert nodes["portable_elements_by_op"] == {
        "aten.index_put.default": 3 * 8,
        "aten.add.Tensor": 3,
    }


@pytest.mark.parametrize("scheme", BUNDLE_SCHEMES)
def test_every_linear_is_delegated_to_xnnpack(checkpoints, lowered, scheme):
    _, result = lowered(scheme)
    details = result.details
    methods = {"prefill_intermediate", "prefill_final", "verify_0", "verify_4"}
    assert set(details["delegation"]) == set(result.method_io) == methods | {"draft_step"}
    for method in details["delegation"].values():
        assert method["delegates"] >= 1
        assert not [
            op
            for op in method["portable_ops"]
            if ("linear" in op or ".mm." in op) and not op.startswith("edgemtp.")
        ]
        # dispatched: fewer than the edge graph's nodes (q/dq pairs, views never run)
        assert 0 < method["runtime_ops"] < method["delegated_nodes"] + method["portable_nodes"]
    assert details["full_xnnpack_pipeline"] == {}  # every delegate preprocessed linear-only
    if scheme == "none":
        assert details["int4_linears"] == {}
        return
    target, drafter = _load(checkpoints, scheme)
    modules = [*target.model.modules(), *drafter.model.modules()]
    # every 4-bit linear but the drafter's head, which is gathered by token id
    assert sum(details["int4_linears"].values()) == sum(int4_of(m) is not None for m in modules) - 1
    # one fp32 offset per block of every 4-bit linear, the drafter's head's too (each has a
    # block with a negative Q4_0 scale or a zero point other than 8), stored dense: what the
    # simulator counts as read
    blocks = sum(w.shape[0] * w.shape[1] // w.group for w in map(int4_of, modules) if w is not None)
    assert details["offset_values"] == blocks
    assert 0 < details["offset_blocks"] < details["offset_values"]
    assert "8da4w" in result.numerics["weights"] and "exact" in result.numerics["weights"]
    # Q4_0 linears of decode, verify and draft steps in edgemtp's kernel; prompt chunks (8 rows,
    # as many as a verify may have) in XNNPACK's 8da4w GEMM
    kernel_calls, gated_calls = (
        {
            name: method["portable_ops"].get(f"edgemtp.{op}.default", 0)
            for name, method in details["delegation"].items()
        }
        for op in ("q4_0_linear", "q4_0_gated_linear")
    )
    if scheme == "q4_0":
        assert kernel_calls["verify_0"] == kernel_calls["verify_4"] > 0
        assert kernel_calls["draft_step"] > 0
        assert kernel_calls["prefill_final"] == kernel_calls["prefill_intermediate"] == 0
        assert "edgemtp::q4_0_linear.out" in details["kernels"]
        # every MLP's down projection (and per-layer input projection) takes its gate in the
        # kernel: no gate/up fusion, no GELU between the kernels
        layers = len(target.model.layers)
        assert gated_calls["verify_0"] == gated_calls["verify_4"] >= layers
        assert gated_calls["prefill_final"] == gated_calls["prefill_intermediate"] == 0
        assert "Q8_0" in result.numerics["q4_0_kernel"]
    assert "int8" in result.numerics["activations"]


def test_context_bucket_methods_read_the_live_cache(checkpoints, tmp_path):
    """An fp32 program with a 24-slot context bucket: its bucketed methods slice the shared
    cache buffer in the program (a stale or copied buffer would read zeros); every bucketed
    decode call returns what the whole-cache method returns on the same cache, and the tokens,
    after a prompt prefilled through the bucket, are the reference engine's computing the
    program's numerics (its float16 K/V cache)."""
    target, _ = _load(checkpoints, "none")
    shapes = StaticShapes(64, 0, 8, (24,))
    result = lower_executorch(
        StaticBundle.build(target.model, None, shapes), "cpu", tmp_path, lambda _: None
    )
    delegation = result.details["delegation"]
    bucketed, whole = (delegation[m]["portable_ops"] for m in ("verify_0_ctx24", "verify_0"))
    extra = {op: n - whole.get(op, 0) for op, n in bucketed.items() if n != whole.get(op, 0)}
    # the full cache's slot positions: the bucket's read (slices) and written back into the
    # buffer (slice_scatter, copy); K/V delegated
    assert extra == {
        "aten.slice_copy.Tensor": 2,
        "aten.slice_scatter.default": 1,
        "aten.copy.default": 1,
    }
    reference, _ = _load(checkpoints, "none", program_numerics=True)
    expected = generate(reference, _prompt(), N_NEW, prefill_chunk=8).tokens
    runner = WholeCacheCheck(ExecuTorchRunner(tmp_path / result.program, shapes))
    got = greedy(StaticBackend(runner, reference.tables, reference.cfg), _prompt(), N_NEW, 0)
    assert got.calls["verify_0_ctx24"] == 3 and got.calls["verify_0"] == N_NEW - 4
    assert got.calls["prefill_final_ctx24"] == 1 and "prefill_final" not in got.calls
    assert runner.worst < 1e-5
    assert got.tokens == expected
    alone = ExecuTorchRunner(tmp_path / result.program, shapes)  # its own bookkeeping only
    got = greedy(StaticBackend(alone, reference.tables, reference.cfg), _prompt(), N_NEW, 0)
    assert got.tokens == expected


@slow
def test_bundle_lowering_is_deterministic(checkpoints, tmp_path):
    programs = []
    for i in range(2):
        target, _ = _load(checkpoints, "q4_0")
        bundle = StaticBundle.build(target.model, None, StaticShapes(64, 0, 8))
        (tmp_path / str(i)).mkdir()
        result = lower_executorch(bundle, "cpu", tmp_path / str(i), lambda _: None)
        programs.append((tmp_path / str(i) / result.program).read_bytes())
    assert programs[0] == programs[1]


@slow
def test_metal_lowers_to_core_ml_and_says_where_it_runs(checkpoints, tmp_path):
    from edgemtp.runtime.runners.executorch import _delegate_backends

    target, _ = _load(checkpoints, "q4_0")
    shapes = StaticShapes(64, 0, 8)
    bundle = StaticBundle.build(target.model, None, shapes)
    result = lower_executorch(bundle, "metal", tmp_path, lambda _: None)
    assert result.files == ["model.pte"] and "CPU_AND_GPU" in result.details["delegate"]
    assert "int4" in result.numerics["weights"] and "fp16" in result.numerics["activations"]
    assert _delegate_backends(tmp_path / result.program) == ["CoreMLBackend"]
    for method in result.details["delegation"].values():  # only the cache writes stay outside
        assert set(method["portable_ops"]) <= {"aten.index_put.default"}
    with pytest.raises(EdgeMTPError, match="CoreMLBackend.*macOS 15"):
        ExecuTorchRunner(tmp_path / result.program, shapes)


@slow
def test_scaled_e2b_bundle_from_the_cli(tmp_path):
    """The E2B preset shrunk 10x (its 262144-token vocabulary and clustered head stay), Q4_0,
    through `edgemtp export --backend executorch`: a verified bundle whose MTP tokens equal its
    AR tokens and that follows the eager reference of its numerics."""
    from edgemtp.cli import main
    from edgemtp.runtime.bundle import open_tables, read_manifest, verify_files

    write_preset("e2b", tmp_path / "none_t", scale=0.1, init_std=0.05)
    write_preset("e2b-assistant", tmp_path / "none_a", scale=0.1, init_std=0.05)
    for role in ("t", "a"):
        quantize_checkpoint(tmp_path / f"none_{role}", tmp_path / f"q4_0_{role}", Settings())
    out = tmp_path / "bundle"
    assert main(
        [
            "export", "--model", str(tmp_path / "q4_0_t"), "--drafter", str(tmp_path / "q4_0_a"),
            "--backend", "executorch", "--max-context", "128", "--draft-depth", "2",
            "--prefill-chunk", "16", "--out", str(out),
        ]
    ) == 0  # fmt: skip
    manifest = read_manifest(out)
    verify_files(out, manifest)
    assert "8da4w" in manifest["numerics"]["weights"]
    reference, _ = _load(tmp_path, "q4_0", program_numerics=True)
    shapes = StaticShapes(**manifest["shapes"])
    tables = open_tables(out, reference.cfg, manifest["tables"])
    runner = ExecuTorchRunner(out / manifest["program"], shapes)
    driver = StaticBackend(runner, tables, reference.cfg)
    prompt = torch.randint(3, 50000, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = greedy(driver, prompt, 32, 0)
    mtp = greedy(driver, prompt, 32, 2)
    assert mtp.tokens == ar.tokens and mtp.drafted > 0
    # This random model is ill-conditioned: int8 activations alone move its logits by 45% of
    # their range, so float-rounding differences that flip a few int8 codes move them by ~20%
    # (measured; tiny: 2%). What stays well-posed: the program is much closer to the eager
    # reference of its numerics than to the fp32-activation one (measured: 19 vs 4 of 32
    # teacher-forced tokens; prefill logits 20% vs 45% off), and their greedy picks agree.
    fp32_reference, _ = _load(tmp_path, "q4_0")
    agree, _ = _teacher_forced(reference, prompt, ar.tokens)
    fp32_agree, _ = _teacher_forced(fp32_reference, prompt, ar.tokens)
    assert agree >= 16 and fp32_agree <= agree // 2
    driver.truncate(0)
    _, got = driver.prefill(prompt, 0)
    errors = []
    for model in (reference, fp32_reference):
        cache = KVCache(model.cfg, shapes.max_context, shapes.max_draft, model.form.cache_dtype)
        _, ref = prefill(model, cache, torch.tensor(prompt), chunk=shapes.chunk)
        errors.append(float((got - ref).abs().max() / ref.abs().max()))
        if model is reference:
            assert int(got.argmax()) == int(ref.argmax())
    assert errors[0] <= 0.3 and errors[0] <= 0.6 * errors[1]


def test_bitset_dependencies_answer_as_executorchs_viewer():
    """The group partitioner's dependency viewer, replaced to keep memory linear in bits: the
    same transitive users (and inputs) for every node of a branching graph."""
    from executorch.exir.backend.canonical_partitioners.group_partitioner import (
        _DependencyViewer,
    )

    from edgemtp.export.executorch_program import BitsetDependencies

    graph = torch.fx.Graph()
    values = [graph.placeholder("x"), graph.placeholder("y")]
    g = torch.Generator().manual_seed(5)
    for _ in range(120):  # each op reads two earlier values: branches, joins, dead ends
        a, b = (values[int(i)] for i in torch.randint(0, len(values), (2,), generator=g))
        values.append(graph.call_function(torch.add, (a, b)))
    graph.output(values[-1])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    # ExecuTorch's own class (replaced in its module once a program has been lowered here)
    reference = (BitsetDependencies.replaced or _DependencyViewer)(gm)
    assert not isinstance(reference, BitsetDependencies)
    ours = BitsetDependencies(gm)
    for node in gm.graph.nodes:
        assert ours.downstreams_of(node) == reference.downstreams_of(node)
        assert ours.upstreams_of(node) == reference.upstreams_of(node)
    assert any(len(ours.downstreams_of(n)) > 50 for n in gm.graph.nodes)

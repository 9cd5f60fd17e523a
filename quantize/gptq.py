"""GPTQ for W4A16: round weights column by column, feeding each column's error forward.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") minimises a layer's output error ||X Wᵀ - X Ŵᵀ||² over calibration inputs X instead
of the weight error. It needs each linear layer's Hessian H = 2/N Σ x xᵀ (`collect_hessians`, from a
float forward over calibration text) and then quantizes one column at a time, spreading the
column's rounding error over the not-yet-quantized columns through the Cholesky factor of H⁻¹
(`gptq_quantize`), as the reference implementations (IST-DASLab's gptq, AutoGPTQ, llm-compressor)
do: dampening λ = damp · mean(diag H), dead inputs (diag 0) zeroed, lazy block updates.

The result is an ordinary `W4A16`: scales and zero points follow exactly the round-to-nearest
definitions of `edgemtp.quantize.w4a16` (computed by `quantize_w4a16` itself on the current,
error-updated weights of each group when the group is entered), so it packs into a valid
compressed-tensors "pack-quantized" tensor and dequantizes through `dequantize_w4a16`. Only the
codes (and, through the updated weights, the group scales) differ from round-to-nearest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KVCache
from edgemtp.model.checkpoint import Target
from edgemtp.model.forward import prefill
from edgemtp.quantize.w4a16 import (
    _SCALE_DTYPES,
    QMAX,
    QMIN,
    W4A16,
    _check_weight,
    _compute_dtype,
    quantize_w4a16,
)

_LM_HEAD = "lm_head"
_DAMP_RETRIES = 4  # Cholesky failures: retry with 10x the dampening this many times


# --- calibration: per-layer Hessians ------------------------------------------------------------


def collect_hessians(
    target: Target,
    token_ids: list[list[int]],
    names: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    chunk: int = 512,
) -> dict[str, Tensor]:
    """H = 2/N Σ x xᵀ [in, in] for each nn.Linear of the float target, over calibration text.

    Every sequence is prefilled (unpruned: every layer sees every row) with a fresh KV cache by
    the reference `prefill`; forward pre-hooks sum xᵀx of each layer's inputs. Keys are module
    names in `target.model.named_modules()` (e.g. "layers.0.self_attn.q_proj", "lm_head"); `names`
    restricts the layers (default: every nn.Linear), which bounds memory to one [in, in] matrix
    per chosen layer (collect the big ones in several passes if needed). KV-shared layers have no
    k_proj/v_proj modules, so they have no Hessian. `lm_head`'s input is the model's final hidden
    state, taken for every row from the model's output (the logits themselves are not computed).
    """
    model = target.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    wanted = list(linears) if names is None else list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in linears]
    if unknown:
        raise EdgeMTPError(
            f"collect_hessians: {', '.join(unknown[:5])} {'is' if len(unknown) == 1 else 'are'} "
            "not nn.Linear modules of the target (names are as in target.model.named_modules(), "
            "e.g. 'layers.0.mlp.down_proj')"
        )
    sequences = [list(s) for s in token_ids if len(s)]
    if not sequences:
        raise EdgeMTPError("collect_hessians needs at least one non-empty calibration sequence")

    sums: dict[str, Tensor] = {}
    rows: dict[str, int] = {}

    def accumulate(name: str, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(dtype)
        if name not in sums:
            sums[name] = torch.zeros(x.shape[1], x.shape[1], dtype=dtype)
            rows[name] = 0
        sums[name].addmm_(x.T, x)
        rows[name] += x.shape[0]

    def pre_hook(name: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        return lambda _module, args: accumulate(name, args[0])

    handles = [linears[n].register_forward_pre_hook(pre_hook(n)) for n in wanted if n != _LM_HEAD]
    if _LM_HEAD in wanted:  # prefill's own logits call sees only the last row: use the output
        handles.append(
            model.register_forward_hook(lambda _m, _a, out: accumulate(_LM_HEAD, out[0]))
        )
    try:
        with torch.no_grad():
            for i, seq in enumerate(sequences):
                cache = KVCache(target.cfg, len(seq))
                ids = torch.tensor(seq, dtype=torch.long)
                prefill(target, cache, ids, chunk, prune=False)
                if progress is not None:
                    progress(f"calibration sequence {i + 1}/{len(sequences)}: {len(seq)} tokens")
    finally:
        for handle in handles:
            handle.remove()
    return {n: sums[n].mul_(2.0 / rows[n]) for n in wanted if n in sums}


# --- GPTQ -----------------------------------------------------------------------------------------


def gptq_quantize(
    w: Tensor,
    hessian: Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    name: str = "tensor",
) -> W4A16:
    """GPTQ W4A16 of a weight [out, in] given its layer's input Hessian [in, in].

    Without `act_order`, columns are quantized left to right and each group's scale (and zero
    point) is that of round-to-nearest on the group's error-updated weights when the group is
    entered. With `act_order`, columns go in order of decreasing diag(H) and the group scales are
    round-to-nearest's on the original weights (llm-compressor's actorder="weight", which needs no
    g_idx in the checkpoint). Rounding runs in round-to-nearest's compute dtype, so with H = c·I
    (no correlations, nothing fed back) the result is exactly `quantize_w4a16`'s. The blocks of
    lazy updates are rounded up to whole groups (the result does not depend on their size).
    """
    _check_weight(w, group_size, name)
    if scale_dtype not in _SCALE_DTYPES:  # quantize_w4a16 would say so, but only per group
        quantize_w4a16(w[:1, :group_size], group_size, symmetric, scale_dtype, name)
    out_features, in_features = w.shape
    if hessian.shape != (in_features, in_features):
        raise EdgeMTPError(
            f"{name}: Hessian has shape {tuple(hessian.shape)}, expected "
            f"{(in_features, in_features)} for a weight of shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise EdgeMTPError(f"{name}: Hessian has NaN/inf values; check the calibration run")
    if not damp >= 0 or block_size <= 0:
        raise EdgeMTPError(f"{name}: need damp >= 0 and block_size > 0, got {damp}, {block_size}")

    H = hessian.detach().to(torch.float64).clone()
    W = w.detach().to(torch.float32).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else None
    static: W4A16 | None = None
    col_group = torch.empty(0, dtype=torch.long)  # with act_order: group of each processed column
    if perm is not None:
        static = quantize_w4a16(W.to(w.dtype), group_size, symmetric, scale_dtype, name)
        W, H = W[:, perm], H[perm][:, perm]
        col_group = perm // group_size
    hinv = _inverse_hessian_cholesky(H, damp, name).to(torch.float32)

    cdtype = _compute_dtype(w.dtype, scale_dtype)
    n_groups = in_features // group_size
    scales = torch.empty(out_features, n_groups, dtype=scale_dtype)
    zeros = torch.zeros(out_features, n_groups, dtype=torch.int8)  # unsigned 0..15
    block = max(block_size // group_size, 1) * group_size
    if static is not None:
        scales.copy_(static.scales)
        if static.zero_points is not None:
            zeros.copy_(static.zero_points)

    # columns as rows: the per-column reads and rank-1 updates touch contiguous memory
    Wt = W.T.contiguous()
    codes_t = torch.empty(in_features, out_features, dtype=torch.int8)
    s = z = torch.empty(0)
    for i1 in range(0, in_features, block):
        i2 = min(i1 + block, in_features)
        w1 = Wt[i1:i2]  # a view: updated in place
        err1 = torch.empty_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                g = int(col_group[col])
                s, z = _group_params(scales[:, g], zeros[:, g], symmetric, cdtype)
            elif col % group_size == 0:
                g = col // group_size
                rtn = quantize_w4a16(
                    w1[i : i + group_size].T.to(w.dtype), group_size, symmetric, scale_dtype, name
                )
                scales[:, g] = rtn.scales[:, 0]
                if rtn.zero_points is not None:
                    zeros[:, g] = rtn.zero_points[:, 0]
                s, z = _group_params(scales[:, g], zeros[:, g], symmetric, cdtype)
            x = w1[i]
            # round-to-nearest's code assignment (quantize_w4a16), in its compute dtype
            q = x.to(w.dtype).to(cdtype) / s
            q += z
            q = q.clamp(QMIN, QMAX).round()
            codes_t[col] = q.to(torch.int8)
            deq = (q.float() - z.float()) * s.float()
            err = (x - deq) / h1[i, i]
            w1[i + 1 :].addr_(h1[i, i + 1 :], err, alpha=-1.0)
            err1[i] = err
        Wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1.0)

    codes = codes_t.T
    codes = codes[:, torch.argsort(perm)] if perm is not None else codes.contiguous()
    if symmetric:
        return W4A16(codes, scales, None, group_size, True)
    return W4A16((codes - QMIN).to(torch.int8), scales, zeros, group_size, False)


def _group_params(
    scales: Tensor, zero_points: Tensor, symmetric: bool, cdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """One group's stored scale and (signed) zero point in round-to-nearest's compute dtype."""
    s = scales.to(cdtype)
    z = torch.zeros_like(s) if symmetric else (zero_points.to(cdtype) + QMIN)
    return s, z


def _inverse_hessian_cholesky(H: Tensor, damp: float, name: str) -> Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ = UᵀU, λ = damp · mean(diag H), in float64; the
    dampening grows tenfold on failure.

    One factorisation instead of the reference's three (cholesky, cholesky_inverse, cholesky):
    with J the reversal permutation and J(H + λI)J = L Lᵀ, U = J L⁻¹ J (same factor to ~1e-14).
    """
    lam = damp * float(torch.diagonal(H).mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    for _ in range(_DAMP_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex((H + lam * eye).flip(0, 1))
        if int(info) == 0:
            return torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
        lam = lam * 10 if lam > 0 else float(torch.diagonal(H).mean()) * 1e-6
    raise EdgeMTPError(
        f"{name}: the Hessian is not positive definite even with dampening {lam / 10:g}; "
        "use more calibration text or a larger damp"
    )

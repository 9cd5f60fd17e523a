"""Tests for edgemtp.runtime.sampling: logits processing, greedy and speculative acceptance."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.sampling import (
    TOP_P_CANDIDATES,
    SamplingParams,
    argmax_rows,
    greedy_accept,
    make_generator,
    probabilities,
    sample,
    speculative_accept,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


# --- SamplingParams ------------------------------------------------------------------------------


def test_params_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_params_validation(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(EdgeMTPError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert word in message and "\n" not in message


def test_params_valid_edges() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None).validate()
    SamplingParams(temperature=2, top_k=50, top_p=1e-3, min_p=0.99, seed=0).validate()


# --- probabilities -------------------------------------------------------------------------------


def _numpy_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Independent float64 reference, written from the definitions row by row."""
    out = np.zeros(logits.shape, dtype=np.float64)
    for r, row in enumerate(logits.astype(np.float64)):
        if params.temperature == 0:
            out[r, int(np.argmax(row))] = 1.0
            continue
        scores = row / params.temperature
        keep = np.isfinite(scores)
        if params.top_k > 0:
            kth = np.sort(scores)[::-1][min(params.top_k, len(scores)) - 1]
            keep &= scores >= kth
        if params.top_p < 1.0:
            probs = _softmax(np.where(keep, scores, -np.inf))
            order = np.argsort(-probs, kind="stable")
            mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
            kept = order[mass_before < params.top_p]  # smallest prefix reaching top_p
            top_p_keep = np.zeros_like(keep)
            top_p_keep[kept] = True
            top_p_keep[order[0]] = True
            keep &= top_p_keep
        if params.min_p > 0.0:
            probs = _softmax(np.where(keep, scores, -np.inf))
            keep &= probs >= params.min_p * probs.max()
        out[r] = _softmax(np.where(keep, scores, -np.inf))
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _transformers_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]] = [
        TemperatureLogitsWarper(float(params.temperature))
    ]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)


@st.composite
def _logits_and_params(
    draw: st.DrawFn, greedy: bool = False
) -> tuple[torch.Tensor, SamplingParams]:
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 40))
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    masked = draw(st.sampled_from([0.0, 0.3, 0.8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(0.0, scale, size=(rows, vocab)).astype(np.float32)
    logits[rng.random((rows, vocab)) < masked] = -np.inf
    logits[np.arange(rows), rng.integers(0, vocab, size=rows)] = rng.normal(0.0, scale, size=rows)
    params = SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([1.0, 0.7]) | st.floats(0.05, 5.0)),
        top_k=draw(st.just(0) | st.integers(1, vocab + 2)),
        top_p=draw(st.just(1.0) | st.floats(0.05, 1.0)),
        min_p=draw(st.just(0.0) | st.floats(0.0, 0.9)),
    )
    return torch.from_numpy(logits), params


@SETTINGS
@given(_logits_and_params())
def test_probabilities_matches_numpy_reference(case: tuple[torch.Tensor, SamplingParams]) -> None:
    logits, params = case
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    expected = _numpy_probabilities(logits.numpy(), params)
    np.testing.assert_allclose(probs.numpy(), expected, rtol=1e-4, atol=1e-6)
    # Filtered tokens are exactly zero; kept ones are positive unless float32 underflows.
    assert (probs.numpy()[expected == 0] == 0).all()
    assert (probs.numpy()[expected > 1e-30] > 0).all()


@SETTINGS
@given(_logits_and_params())
def test_probabilities_matches_transformers(case: tuple[torch.Tensor, SamplingParams]) -> None:
    logits, params = case
    probs = probabilities(logits, params)
    expected = _transformers_probabilities(logits, params)
    # Same operations in the same order: equal up to float32 rounding.
    np.testing.assert_allclose(probs.numpy(), expected.numpy(), rtol=1e-5, atol=1e-7)
    assert torch.equal(probs > 0, expected > 0)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(_logits_and_params(greedy=True))
def test_greedy_probabilities_are_one_hot_at_argmax(
    case: tuple[torch.Tensor, SamplingParams],
) -> None:
    logits, params = case
    probs = probabilities(logits, params)
    expected = torch.zeros_like(logits)
    expected[torch.arange(logits.shape[0]), logits.argmax(-1)] = 1.0
    assert torch.equal(probs, expected)


def test_probabilities_rows_are_independent_and_accept_any_float_dtype() -> None:
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(2, 3, 50)).astype(np.float32))
    logits[0, 1, :45] = -math.inf
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    batched = probabilities(logits, params)
    for i in range(2):
        for j in range(3):
            single = probabilities(logits[i, j], params)
            np.testing.assert_allclose(batched[i, j].numpy(), single.numpy(), rtol=1e-6, atol=0)
    half = probabilities(logits.bfloat16(), params)
    assert half.dtype == torch.float32
    np.testing.assert_allclose(half.sum(-1).numpy(), np.ones((2, 3)), rtol=1e-6)


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -math.inf]])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("top_k", [0, 3000])
@pytest.mark.parametrize(("scale", "top_p"), [(3.0, 0.3), (3.0, 0.95), (0.05, 0.9999)])
def test_top_p_on_a_large_vocabulary_matches_both_oracles(
    scale: float, top_p: float, top_k: int
) -> None:
    # Past TOP_P_CANDIDATES: top_p 0.3 settles inside the first candidates, 0.95 and 0.9999
    # need the search to widen (checked below by the kept count).
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.normal(0.0, scale, size=(2, 6000)).astype(np.float32))
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
    probs = probabilities(logits, params)
    expected = _numpy_probabilities(logits.numpy(), params)
    np.testing.assert_allclose(probs.numpy(), expected, rtol=1e-4, atol=1e-7)
    assert torch.equal(probs > 0, _transformers_probabilities(logits, params) > 0)
    kept = int((probs[0] > 0).sum())
    assert (kept > TOP_P_CANDIDATES) == (top_p > 0.9)


# --- sample ----------------------------------------------------------------------------------


def test_sample_shapes_support_and_determinism() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.1, 0.0, 0.0, 0.9]])
    g = make_generator(0)
    assert sample(probs[0], g).shape == ()
    draws = torch.stack([sample(probs, g) for _ in range(300)])
    assert draws.shape == (300, 2) and draws.dtype == torch.int64
    assert set(draws[:, 0].tolist()) == {1, 2}
    assert set(draws[:, 1].tolist()) == {0, 3}
    frequency_of_3 = float((draws[:, 1] == 3).float().mean())
    assert abs(frequency_of_3 - 0.9) < 4 * math.sqrt(0.9 * 0.1 / 300)
    unnormalised = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0])
    counts = torch.bincount(
        torch.stack([sample(unnormalised, g) for _ in range(2000)]), minlength=5
    )
    assert counts[[0, 2, 4]].sum() == 0
    assert scipy.stats.binomtest(int(counts[1]), 2000, 0.75).pvalue > 1e-4
    a = [int(sample(probs[1], make_generator(42))) for _ in range(5)]
    b = [int(sample(probs[1], make_generator(42))) for _ in range(5)]
    assert a == b
    assert isinstance(make_generator(None), torch.Generator)


# --- greedy_accept ---------------------------------------------------------------------------


def _logits_with_argmax(choices: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.randn(len(choices), vocab, generator=make_generator(0))
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return logits


@pytest.mark.parametrize(
    ("drafts", "expected"),
    [
        ([3, 1, 4], (3, 5)),  # all accepted: the bonus token is the argmax of the last row
        ([0, 1, 4], (0, 3)),  # first rejected: the correction is the argmax of row 0
        ([3, 1, 7], (2, 4)),  # third rejected
        ([3, 2, 4], (1, 1)),  # middle rejected even though a later draft matches
        ([], (0, 3)),  # k = 0: plain greedy step
    ],
)
def test_greedy_accept(drafts: list[int], expected: tuple[int, int]) -> None:
    choices = [3, 1, 4, 5]
    logits = _logits_with_argmax(choices[: len(drafts) + 1])
    assert greedy_accept(logits, drafts) == expected


def test_greedy_accept_checks_shapes() -> None:
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(torch.zeros(2, 5), [1, 2])


# --- speculative_accept: exact checks --------------------------------------------------------


def test_speculative_accept_k0_samples_the_target() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    out = speculative_accept(
        target, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), make_generator(0)
    )
    assert out == (0, 2)


def test_speculative_accept_rejects_tokens_the_target_forbids() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.9, 0.1, 0.0, 0.0]])
    g = make_generator(1)
    for _ in range(50):
        n, token = speculative_accept(target, draft, torch.tensor([0]), g)
        assert n == 0 and token in (1, 2)


def test_speculative_accept_always_accepts_when_draft_equals_target() -> None:
    target = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    g = make_generator(2)
    for drafts in ([0, 0], [1, 2], [1, 0]):
        assert speculative_accept(target, target[:2], torch.tensor(drafts), g) == (2, 2)


def test_speculative_accept_falls_back_to_target_when_residual_is_zero() -> None:
    # An unnormalised draft row that dominates the target everywhere: rejection is possible
    # (q(d) > p(d)) but max(0, p - q) is all zero, so the replacement comes from p.
    target = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[1.0, 0.5, 0.0]])
    g = make_generator(3)
    results = {speculative_accept(target, draft, torch.tensor([0]), g) for _ in range(100)}
    assert results == {(1, 0), (0, 0), (0, 1)}


def test_speculative_accept_rejects_bad_inputs() -> None:
    g = make_generator(0)
    target = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="zero draft probability"):
        speculative_accept(target, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([0]), g)
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_accept(target, torch.full((2, 4), 0.25), torch.tensor([0]), g)
    with pytest.raises(ValueError, match="target_probs"):
        speculative_accept(target, torch.full((2, 4), 0.25), torch.tensor([0, 1]), g)


# --- speculative_accept: the target distribution is preserved (statistical) ------------------

VOCAB = 8
ALPHA = 1e-3  # a correct implementation must pass at this level
POWER = 1e-8  # a wrong one must fail at this level

Accept = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]


def _rows(k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Target rows P[t] for absolute positions 0..k+1 and draft rows Q[t] for 0..k.

    Both depend only on the position, not on the tokens before it, so the first two emitted
    tokens must be independent with marginals P[0] and P[1]. Each draft row is zero on three
    tokens, like the clustered head's subset.
    """
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.full(VOCAB, 8.0), size=k + 2).astype(np.float32)
    draft = rng.dirichlet(np.full(VOCAB, 1.0), size=k + 1)
    for row in draft:
        row[rng.choice(VOCAB, size=3, replace=False)] = 0.0
    draft = (draft / draft.sum(-1, keepdims=True)).astype(np.float32)
    return target, draft


def _simulate(accept: Accept, k: int, trials: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Decode until two tokens are out, `trials` times: (first two tokens [T, 2], n of round 1 [T]).

    Every round drafts k tokens from the draft rows at its positions and verifies them against
    the target rows at its positions, as the engine does.
    """
    target_np, draft_np = _rows(k)
    target, draft = torch.from_numpy(target_np), torch.from_numpy(draft_np)
    g = make_generator(seed)
    # Drafts for round 1 (positions 0..k-1) and, when needed, round 2 (positions 1..k).
    first_drafts = second_drafts = torch.zeros(trials, 0, dtype=torch.long)
    if k:
        first_drafts = torch.multinomial(draft[:k], trials, replacement=True, generator=g).T
        second_drafts = torch.multinomial(draft[1:], trials, replacement=True, generator=g).T
    tokens = np.zeros((trials, 2), dtype=np.int64)
    first_n = np.zeros(trials, dtype=np.int64)
    for t in range(trials):
        drafts = first_drafts[t]
        n, token = accept(target[: k + 1], draft[:k], drafts, g)
        out = drafts[:n].tolist() + [token]
        first_n[t] = n
        if len(out) < 2:
            drafts = second_drafts[t]
            n, token = accept(target[1 : k + 2], draft[1 : k + 1], drafts, g)
            out += drafts[:n].tolist() + [token]
        tokens[t] = out[:2]
    return tokens, first_n


@functools.cache
def _correct_run(k: int) -> tuple[np.ndarray, np.ndarray]:
    return _simulate(speculative_accept, k, trials=2000 if k == 0 else 4000)


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    probs = probs.astype(np.float64).ravel()
    probs /= probs.sum()
    expected = probs * len(samples)
    assert expected.min() >= 5, "too few draws for a chi-square test"
    observed = np.bincount(samples, minlength=len(probs))
    return float(scipy.stats.chisquare(observed, expected).pvalue)


def _first_token_pvalue(tokens: np.ndarray, k: int) -> float:
    target, _ = _rows(k)
    return _chi2_pvalue(tokens[:, 0], target[0])


def _first_two_tokens_pvalue(tokens: np.ndarray, k: int) -> float:
    target, _ = _rows(k)
    joint = np.outer(target[0].astype(np.float64), target[1].astype(np.float64))
    return _chi2_pvalue(tokens[:, 0] * VOCAB + tokens[:, 1], joint)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_speculative_first_token_follows_target(k: int) -> None:
    tokens, _ = _correct_run(k)
    assert _first_token_pvalue(tokens, k) > ALPHA


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_first_two_tokens_follow_target(k: int) -> None:
    tokens, _ = _correct_run(k)
    assert _first_two_tokens_pvalue(tokens, k) > ALPHA


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_acceptance_rate_is_optimal(k: int) -> None:
    # Draft i is accepted with probability a_i = sum_x min(p_i(x), q_i(x)), independently here,
    # so n is j with probability a_0 ... a_{j-1} (1 - a_j). This catches a "never accept" bug,
    # which keeps the target distribution but wastes every draft.
    _, first_n = _correct_run(k)
    target, draft = _rows(k)
    a = np.minimum(target[:k], draft[:k]).sum(-1).astype(np.float64)
    probs = np.array([np.prod(a[:j]) * (1 - a[j]) for j in range(k)] + [np.prod(a)])
    assert _chi2_pvalue(first_n, probs) > ALPHA


def _always_accept(
    target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    k = drafts.shape[0]
    return k, int(sample(target[k], g))


def _resample_from_target(
    target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    """Right acceptance test, wrong replacement: samples p_i instead of norm(max(0, p_i - q_i))."""
    for i, d in enumerate(drafts.tolist()):
        if float(torch.rand((), generator=g)) >= float(target[i, d] / draft[i, d]):
            return i, int(sample(target[i], g))
    return len(drafts), int(sample(target[len(drafts)], g))


@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_target])
def test_statistical_check_catches_wrong_acceptance(wrong: Accept) -> None:
    tokens, _ = _simulate(wrong, k=3, trials=1500, seed=1)
    assert _first_token_pvalue(tokens, 3) < POWER
    assert _first_two_tokens_pvalue(tokens, 3) < POWER


@given(
    st.integers(1, 5),
    st.integers(1, 300),
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
@SETTINGS
def test_argmax_rows_is_torchs_argmax_ties_included(rows, vocab, seed, dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # many ties
    assert argmax_rows(logits) == logits.float().argmax(-1).tolist()
    assert argmax_rows(logits[0]) == [int(logits[0].float().argmax())]

"""The apps' C++ sampling, speculative acceptance, adaptive depth and sampled decoding
(`apps/core`: sampling.cpp, adaptive.cpp, decode.cpp) against the Python runtime.

`sampling_cli` (apps/core/tests/sampling_cli_test.cpp) runs JSON cases through the core; each
test compares its answers with an oracle that does not go through the core:
runtime.sampling.probabilities, runtime.sampling.speculative_accept (fed the same uniforms) and
a numpy rewrite of its rule, runtime.adaptive.AdaptiveDepth fed the same rounds, a reference
xoshiro256**, and the exact distributions that sampling must reproduce (chi-square, with fixed
seeds so every run draws the same numbers).
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes
from edgemtp.runtime import sampling
from edgemtp.runtime.adaptive import AdaptiveDepth
from edgemtp.runtime.generate import Step
from edgemtp.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def cli(core_build: Path) -> Callable[[list[dict]], list[dict]]:
    """Runs cases through sampling_cli: one result per case."""

    def run(cases: list[dict]) -> list[dict]:
        done = subprocess.run(
            [str(core_build / "sampling_cli")],
            input=json.dumps({"cases": cases}, allow_nan=False),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout)["results"]
        assert len(results) == len(cases)
        return results

    return run


def _json_row(row: np.ndarray) -> list[float | None]:
    """A float32 row for JSON, -inf as null."""
    return [None if math.isinf(x) and x < 0 else float(x) for x in row.tolist()]


# --- the generator ----------------------------------------------------------------------------

MASK = (1 << 64) - 1


def _xoshiro256ss(seed: int, count: int) -> list[int]:
    """xoshiro256** (Blackman and Vigna) seeded with four splitmix64 outputs of `seed`."""

    def rotl(x: int, k: int) -> int:
        return ((x << k) | (x >> (64 - k))) & MASK

    state, words = seed, []
    for _ in range(4):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        words.append(z ^ (z >> 31))
    s0, s1, s2, s3 = words
    out = []
    for _ in range(count):
        out.append(rotl((s1 * 5) & MASK, 7) * 9 & MASK)
        t = (s1 << 17) & MASK
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = rotl(s3, 45)
    return out


def test_rng_is_xoshiro256starstar_seeded_by_splitmix64(cli):
    seeds = [0, 1, 42, 2**63 - 1]
    results = cli([{"op": "rng", "seed": s, "count": 50} for s in seeds])
    for seed, got in zip(seeds, results, strict=True):
        want = _xoshiro256ss(seed, 50)
        assert [int(x, 16) for x in got["u64"]] == want
        assert got["uniform"] == [(x >> 11) * 2.0**-53 for x in want]


# --- probabilities ----------------------------------------------------------------------------

PARAMS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 1},
    {"temperature": 0.9, "top_k": 5},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 1.0, "top_k": 5000},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.3},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.0, "top_p": 0.75},
    {"temperature": 1.0, "top_p": 0.99},
    {"temperature": 0.6, "min_p": 0.1},
    {"temperature": 1.0, "min_p": 0.3},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.5, "top_k": 3, "top_p": 0.5},
    {"temperature": 1.0, "top_p": 0.7, "min_p": 0.2},
]


def _rows() -> dict[str, np.ndarray]:
    gen = np.random.default_rng(20260611)
    rows = {f"normal_{n}": (gen.standard_normal(n) * 2.5).astype(np.float32) for n in (7, 64, 1000)}
    # Flat enough that top-p 0.99 needs more than the first 256 candidates.
    rows["wide_3000"] = (gen.standard_normal(3000) * 0.5).astype(np.float32)
    rows["ties_int_40"] = gen.integers(0, 4, 40).astype(np.float32)
    rows["ties_half_300"] = (gen.integers(-2, 3, 300) * 0.5).astype(np.float32)
    rows["ties_flat_600"] = np.full(600, 0.25, dtype=np.float32)
    # Masses of exactly 1/4 and 1/16: top-p 0.5 and 0.75 land on a token's running mass.
    rows["ties_flat_4"] = np.zeros(4, dtype=np.float32)
    rows["ties_flat_16"] = np.zeros(16, dtype=np.float32)
    rows["ties_top_8"] = np.array([2, 2, 2, 1, 1, 0, 2, -1], dtype=np.float32)
    masked = (gen.standard_normal(50) * 2).astype(np.float32)
    masked[gen.random(50) < 0.4] = -np.inf
    rows["masked_50"] = masked
    return rows


def test_probabilities_match_the_python_runtime(cli):
    """Exact support and values within 1e-6 of runtime.sampling.probabilities, over random and
    tie-heavy rows and every filter. Where top-p's cut falls inside a group of equal scores the
    Python runtime keeps whichever of them torch.topk lists first (an unspecified order); the
    core keeps the lowest ids: there the same number of that group must be kept, the rest of
    the support must be equal, and the values must match as a multiset."""
    rows = _rows()
    cases = [
        {"op": "probabilities", "logits": _json_row(row), "params": params}
        for row in rows.values()
        for params in PARAMS
    ]
    results = cli(cases)
    exact = tie_cuts = 0
    for case, result, (name, row) in zip(
        cases, results, [(n, r) for n, r in rows.items() for _ in PARAMS], strict=True
    ):
        params = case["params"]
        where = f"{name} {params}"
        assert "probs" in result, f"{where}: {result}"
        want = sampling.probabilities(torch.from_numpy(row), SamplingParams(**params)).numpy()
        got = np.array(result["probs"], dtype=np.float64)
        assert got.shape == want.shape, where
        if np.array_equal(got > 0, want > 0):
            exact += 1
            assert np.abs(got - want).max() <= 1e-6, where
            continue
        # Only a top-p cut through equal scores may choose differently.
        assert params.get("top_p", 1.0) < 1.0, f"{where}: supports differ"
        scores = (torch.from_numpy(row) / params["temperature"]).numpy()
        cut = scores[want > 0].min()
        assert scores[got > 0].min() == cut, where
        differ = np.flatnonzero((got > 0) != (want > 0))
        assert (scores[differ] == cut).all(), f"{where}: supports differ outside the tied cut"
        group = np.flatnonzero(scores == cut)
        kept = int((want[group] > 0).sum())
        assert ((got[group] > 0) == (np.arange(len(group)) < kept)).all(), where
        assert np.abs(np.sort(got) - np.sort(want)).max() <= 1e-6, where
        assert name.startswith("ties_"), where
        tie_cuts += 1
    assert tie_cuts >= 1 and exact + tie_cuts == len(cases), (exact, tie_cuts)


VALIDATE = [
    {"temperature": -1.0},
    {"temperature": "nan"},
    {"temperature": "-inf"},
    {"temperature": "inf"},
    {"temperature": -1e-05},
    {"temperature": -1.2345678901234567e16},
    {"temperature": 1.0, "top_k": -3},
    {"temperature": 1.0, "top_p": 0.0},
    {"temperature": 1.0, "top_p": 1.5},
    {"temperature": 1.0, "top_p": "nan"},
    {"temperature": 1.0, "min_p": -0.25},
    {"temperature": 1.0, "min_p": 1.0},
    {"temperature": 1.0, "min_p": "nan"},
    {"temperature": 0.0},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1e-05, "top_p": 1.0, "min_p": 0.0},
]


def test_validate_refuses_as_the_python_runtime(cli):
    """The same parameters are refused with the same one-line message (or both accepted)."""
    results = cli([{"op": "validate", "params": params} for params in VALIDATE])
    refused = 0
    for params, result in zip(VALIDATE, results, strict=True):
        values = {k: float(v) if isinstance(v, str) else v for k, v in params.items()}
        try:
            SamplingParams(**values)
            want = None
        except EdgeMTPError as e:
            want = str(e)
            refused += 1
        assert result.get("error") == want, params
        assert (want is None) == result.get("ok", False), params
    assert refused == 13


# --- speculative acceptance -------------------------------------------------------------------


def _sample_reference(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs.astype(np.float64))
    x = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
    return int(np.searchsorted(cdf, x, side="right"))


def _accept_reference(target, draft, drafts, uniforms) -> tuple[int, int]:
    """runtime.sampling.speculative_accept's rule, in numpy, with its uniforms given."""
    k, n = len(drafts), 0
    while n < k and uniforms[n] * float(draft[n][drafts[n]]) < float(target[n][drafts[n]]):
        n += 1
    if n == k:
        return n, _sample_reference(target[k], uniforms[k])
    residual = np.maximum(target[n] - draft[n], np.float32(0))
    return n, _sample_reference(residual if residual.any() else target[n], uniforms[k])


def _simplex(gen: np.random.Generator, v: int, support: np.ndarray | None = None) -> np.ndarray:
    row = gen.dirichlet(np.full(v, 0.7))
    if support is not None:
        support = support.copy()
        support[gen.integers(v)] = True
        row = np.where(support, row, 0.0)
    return (row / row.sum()).astype(np.float32)


def _accept_cases() -> list[dict]:
    gen = np.random.default_rng(7)
    cases = []
    for i in range(400):
        v = [2, 5, 16][i % 3]
        k = i % 4
        target = [
            _simplex(gen, v, gen.random(v) < 0.8 if i % 5 == 0 else None) for _ in range(k + 1)
        ]
        draft = []
        for j in range(k):
            if i % 7 == 0:
                draft.append(target[j].copy())  # the target's own distribution: always kept
            else:
                candidates = gen.random(v) < 0.5  # a clustered head: zero elsewhere
                draft.append(_simplex(gen, v, candidates if i % 2 else None))
        drafts = [int(gen.choice(v, p=q / q.sum())) for q in (r.astype(np.float64) for r in draft)]
        uniforms = [float(np.float32(u)) for u in gen.random(k + 1)]
        cases.append({"target": target, "draft": draft, "drafts": drafts, "uniforms": uniforms})
    # A draft the target never emits is rejected even by a uniform of 0.
    cases.append(
        {
            "target": [np.array([0, 1], np.float32), np.array([1, 0], np.float32)],
            "draft": [np.array([1, 0], np.float32)],
            "drafts": [0],
            "uniforms": [0.0, 0.5],
        }
    )
    # Rows that are not distributions: a rejection whose residual is all zero.
    cases.append(
        {
            "target": [np.array([0.25, 0.25], np.float32), np.array([1, 0], np.float32)],
            "draft": [np.array([0.5, 0.5], np.float32)],
            "drafts": [0],
            "uniforms": [0.875, 0.75],
        }
    )
    return cases


def test_speculative_accept_with_given_uniforms(cli, monkeypatch):
    """The same (accepted, next token) as a numpy rewrite of runtime.sampling.speculative_accept's
    rule and as the function itself, with torch.rand answering the same uniforms."""
    cases = _accept_cases()
    results = cli(
        [
            {
                "op": "accept",
                "target": [r.tolist() for r in c["target"]],
                "draft": [r.tolist() for r in c["draft"]],
                "drafts": c["drafts"],
                "uniforms": c["uniforms"],
            }
            for c in cases
        ]
    )
    queue: list[float] = []

    def given_rand(*size, generator=None, device=None):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        n = math.prod(shape)
        values = [queue.pop(0) for _ in range(n)]
        return torch.tensor(values, dtype=torch.float32).reshape(shape)

    monkeypatch.setattr(torch, "rand", given_rand)
    outcomes = set()
    for case, result in zip(cases, results, strict=True):
        target, draft, drafts, uniforms = (
            case[x] for x in ("target", "draft", "drafts", "uniforms")
        )
        got = (result["accepted"], result["next"])
        assert got == _accept_reference(target, draft, drafts, uniforms), case
        queue[:] = list(uniforms)
        python = sampling.speculative_accept(
            torch.from_numpy(np.stack(target)),
            torch.from_numpy(np.stack(draft)) if draft else torch.zeros(0, len(target[0])),
            torch.tensor(drafts, dtype=torch.long),
            torch.Generator(),
        )
        assert not queue
        assert got == python, case
        outcomes.add((len(drafts), got[0]))
    # Every number of accepted drafts occurred at every depth.
    assert outcomes >= {(k, n) for k in range(4) for n in range(k + 1)}


def _chi_square_ok(observed: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Chi-square goodness of fit at the 0.001 level, cells with an expected count under 5
    pooled: (fits, statistic, critical value). A count in a cell of probability 0 never fits."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if observed[probs == 0].sum() > 0:
        return False, math.inf, 0.0
    expected = probs * observed.sum()
    small = (expected < 5) & (probs > 0)
    obs = np.append(observed[expected >= 5], observed[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    keep = exp > 0
    statistic = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    try:
        from scipy.stats import chi2

        critical = float(chi2.ppf(0.999, dof))
    except ImportError:  # Wilson-Hilferty, z(0.999) = 3.0902
        h = 2 / (9 * dof)
        critical = dof * (1 - h + 3.0902 * math.sqrt(h)) ** 3
    return statistic < critical, statistic, critical


def test_speculative_sampling_commits_the_target_distribution(cli):
    """Over 200 000 seeded trials each, the first committed token (an accepted draft or the
    correction) is distributed as the target's first row, whatever the drafter (random, a
    clustered head's, one-hot); the chance of accepting the first draft is sum(min(p, q)); and
    the same counts fail the test against the drafter's distribution (the test has power)."""
    gen = np.random.default_rng(11)
    setups = []
    setups.append(([_simplex(gen, 6) for _ in range(2)], [_simplex(gen, 6)]))
    clustered = [_simplex(gen, 8, np.isin(np.arange(8), [1, 4, 6])) for _ in range(3)]
    setups.append(([_simplex(gen, 8) for _ in range(4)], clustered))
    one_hot = [np.eye(5, dtype=np.float32)[j] for j in (2, 0)]
    setups.append(([_simplex(gen, 5) for _ in range(3)], one_hot))
    trials = 200_000
    results = cli(
        [
            {
                "op": "accept_counts",
                "target": [r.tolist() for r in target],
                "draft": [r.tolist() for r in draft],
                "trials": trials,
                "seed": 100 + i,
            }
            for i, (target, draft) in enumerate(setups)
        ]
    )
    for (target, draft), result in zip(setups, results, strict=True):
        first = np.array(result["first"])
        fits, statistic, critical = _chi_square_ok(first, target[0])
        assert fits, (statistic, critical)
        assert not _chi_square_ok(first, draft[0])[0]
        p_accept = float(np.minimum(target[0], draft[0]).astype(np.float64).sum())
        rejected = result["accepted"][0]
        sd = math.sqrt(trials * p_accept * (1 - p_accept))
        assert abs((trials - rejected) - trials * p_accept) < 4 * sd


# --- sampled decoding -------------------------------------------------------------------------


def _sequence_probs(target_probs: list[np.ndarray], prompt: list[int], tokens: int) -> np.ndarray:
    """P(t_0..t_{tokens-1}): t_i is drawn from target_probs[phase][t_{i-1}] (t_{-1} is the
    prompt's last token), the phase of the row's position, (len(prompt) - 1 + i) % phases."""
    phases = len(target_probs)
    start = len(prompt) - 1
    joint = target_probs[start % phases][prompt[-1]].astype(np.float64)
    for i in range(1, tokens):
        step = target_probs[(start + i) % phases].astype(np.float64)  # [previous, next]
        joint = np.einsum("...a,ab->...ab", joint, step)
    return joint


def test_sampled_decoding_follows_the_target_distribution(cli):
    """The Decoder at temperature > 0 over a Markov model (the target's row depends on the token
    and its position's parity; the drafter disagrees) generates 4 tokens 60 000 times, one seed
    each, at depth 3: the joint distribution of the 4 tokens must be the target chain's under
    runtime.sampling.probabilities (and not the drafter's chain). Once with a full drafter, once
    with a clustered head's candidates."""
    gen = np.random.default_rng(5)
    vocab, prompt = 5, [1, 3, 2]
    target = [(gen.standard_normal((vocab, vocab)) * 1.5).astype(np.float32) for _ in range(2)]
    draft = (gen.standard_normal((vocab, vocab)) * 1.5).astype(np.float32)
    candidates = [sorted(gen.choice(vocab, 3, replace=False).tolist()) for _ in range(vocab)]
    draft_candidates = np.stack([draft[t][candidates[t]] for t in range(vocab)])
    setups = [
        ({"temperature": 0.8, "top_k": 4, "min_p": 0.05}, draft, None),
        ({"temperature": 1.0, "top_p": 0.9}, draft_candidates, candidates),
    ]
    cases = []
    for params, drafter, ids in setups:
        case = {
            "op": "decode",
            "target": [t.tolist() for t in target],
            "draft": drafter.tolist(),
            "prompt": prompt,
            "max_new_tokens": 4,
            "depth": 3,
            "params": params,
            "seeds": [1000, 60_000],
        }
        if ids is not None:
            case["candidates"] = ids
        cases.append(case)
    results = cli(cases)
    for (params, drafter, ids), result in zip(setups, results, strict=True):
        assert "counts" in result, result
        p = SamplingParams(**params)
        want = _sequence_probs(
            [sampling.probabilities(torch.from_numpy(t), p).numpy() for t in target], prompt, 4
        )
        observed = np.zeros((vocab,) * 4)
        for key, n in result["counts"].items():
            observed[tuple(int(t) for t in key.split(","))] += n
        assert observed.sum() == 60_000
        fits, statistic, critical = _chi_square_ok(observed, want)
        assert fits, (params, statistic, critical)
        # The drafter's own chain (its distribution at every step) is told apart.
        local = sampling.probabilities(torch.from_numpy(drafter), p).numpy()
        q = np.zeros((vocab, vocab), dtype=np.float32)
        for t in range(vocab):
            q[t, ids[t] if ids is not None else np.arange(vocab)] = local[t]
        assert not _chi_square_ok(observed, _sequence_probs([q], prompt, 4))[0]
        assert 0 < result["accepted"] < result["drafted"]


# --- adaptive depth ---------------------------------------------------------------------------


def _adaptive_rounds(
    policy: AdaptiveDepth,
    accept: Callable[[int, int, np.random.Generator], int],
    seed: int,
    draft_step_s: float = 0.0012,
    verify_base_s: Callable[[int], float] = lambda k: 0.009 + 0.0004 * (k + 1),
) -> list[dict]:
    """Drives `policy` through 400 synthetic rounds (limits, acceptance, noisy draft and verify
    seconds with spikes) and records what each round fed it and what it chose."""
    gen = np.random.default_rng(seed)
    out = []
    for i in range(400):
        limit = (
            policy.max_depth if gen.random() < 0.85 else int(gen.integers(0, policy.max_depth + 1))
        )
        k = policy.choose(limit)
        estimate = {str(d): r for d, r in policy.last_estimate.items()}
        accepted = accept(i, k, gen)
        draft_s = k * draft_step_s * (1 + 0.4 * gen.random()) if k else 0.0
        verify_s = verify_base_s(k) + 0.002 * gen.random()
        if gen.random() < 0.05:
            verify_s += 0.03  # another app's burst
        step = Step("decode", 0, k + 1, drafted=k, accepted=accepted, committed=accepted + 1)
        step.seconds = {"drafter": draft_s, "total": draft_s + verify_s}
        policy.observe(step)
        out.append(
            {
                "limit": limit,
                "depth": k,
                "accepted": accepted,
                "draft_s": draft_s,
                "verify_s": step.seconds["total"] - step.seconds["drafter"],
                "estimate": estimate,
            }
        )
    return out


def _geometric(rate: float) -> Callable[[int, int, np.random.Generator], int]:
    def accept(i: int, k: int, gen: np.random.Generator) -> int:
        n = 0
        while n < k and gen.random() < rate:
            n += 1
        return n

    return accept


def test_adaptive_depth_chooses_as_the_python_runtime(cli):
    """runtime.adaptive.AdaptiveDepth and the C++ AdaptiveDepth see the same rounds: every
    round's choice, and the expected rates behind it, must be the same."""
    rows = lambda k: f"rows_{k + 1}"  # noqa: E731 - a verify cost that grows with the rows
    static = lambda k: "verify_0" if k == 0 else "verify_4"  # noqa: E731
    bundle = StaticShapes(512, 3, 16, (128,))
    scenarios = {
        "mixed": (AdaptiveDepth(4, rows), _geometric(0.65)),
        # No acceptance prior, free drafts, one verify method for k >= 1: every k >= 1 has the
        # same rate, and the tie goes to the shallowest.
        "ties": (AdaptiveDepth(4, static, prior_accept=0.0), lambda i, k, gen: 0),
        "never_agrees": (AdaptiveDepth(4, static), lambda i, k, gen: 0),
        "always_agrees": (AdaptiveDepth(4, static), lambda i, k, gen: k),
        "drifts": (
            AdaptiveDepth(4, rows),
            lambda i, k, gen: k if i < 150 else (1 if k and gen.random() < 0.1 else 0),
        ),
        "priors": (
            AdaptiveDepth(3, rows, decay=1.0, prior_accept=0.3, prior_trials=4.0),
            _geometric(0.4),
        ),
        "bundle": (AdaptiveDepth(3, lambda k: bundle.verify_method(k)[0]), _geometric(0.8)),
    }
    cases, records = [], {}
    for i, (name, (policy, accept)) in enumerate(scenarios.items()):
        if name == "ties":
            records[name] = _adaptive_rounds(
                policy, accept, i, 0.0, lambda k: 0.013 if k == 0 else 0.010
            )
        else:
            records[name] = _adaptive_rounds(policy, accept, seed=i)
        case = {
            "op": "adaptive",
            "rounds": [{k: v for k, v in r.items() if k != "estimate"} for r in records[name]],
        }
        if name == "bundle":
            case["bundle"] = {
                "max_context": bundle.max_context,
                "max_draft": bundle.max_draft,
                "chunk": bundle.chunk,
                "context_buckets": list(bundle.context_buckets),
            }
        else:
            case.update(
                max_depth=policy.max_depth,
                shapes=[policy.verify_shape(k) for k in range(policy.max_depth + 1)],
                decay=policy.decay,
                prior_accept=policy.prior[0],
                prior_trials=policy.prior[1],
            )
        cases.append(case)
    results = cli(cases)
    for name, result in zip(scenarios, results, strict=True):
        assert "choices" in result, (name, result)
        want = [r["depth"] for r in records[name]]
        assert result["choices"] == want, name
        assert result["estimates"] == [r["estimate"] for r in records[name]], name
    # The scenarios reach the policy's corners.
    depths = {name: [r["depth"] for r in records[name]] for name in scenarios}
    assert depths["never_agrees"][:4] == [1, 0, 1, 0]
    assert depths["never_agrees"][4:].count(0) > 0.8 * 396
    assert depths["always_agrees"][-100:].count(4) > 80
    assert len(set(depths["mixed"][4:])) >= 3
    assert depths["ties"][4:].count(1) > 0.8 * 396
    assert depths["drifts"][100:150].count(4) > 30 and depths["drifts"][-100:].count(0) > 50

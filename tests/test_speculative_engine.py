"""Speculative sampling through the whole engine keeps the target's distribution.

Tiny vocabulary (16 tokens) and a clustered drafter head (its draft distribution is zero outside
the chosen clusters). The oracle is the target itself: the distributions of the 2nd and 3rd
generated tokens, summed over every possible earlier token, are compared with MTP draws by a
chi-square test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_oracle import build_assistant, build_target
from scipy.stats import chisquare

from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.generate import generate
from edgemtp.runtime.sampling import SamplingParams

V = 16
PROMPT = [3, 7, 1, 12, 5]
DRAWS = 1000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    hf = build_target(
        root / "t",
        vocab_size=V,
        vocab_size_per_layer_input=V,
        sliding_window=4,
        initializer_range=0.2,
    )
    build_assistant(root / "a", hf.config, ordered=True)
    target = load_target(root / "t")
    return hf, target


def exact_marginals(hf) -> tuple[np.ndarray, np.ndarray]:
    """P(x2) and P(x3) after PROMPT under temperature-1 sampling from the target."""
    prompt = torch.tensor(PROMPT)
    p1 = torch.softmax(hf(prompt[None]).logits[0, -1].double(), -1)
    seq2 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2_given_1 = torch.softmax(hf(seq2).logits[:, -1].double(), -1)  # [x1, x2]
    joint12 = p1[:, None] * p2_given_1
    seq3 = torch.cat([seq2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3_given_12 = torch.softmax(hf(seq3).logits[:, -1].double(), -1).view(V, V, V)
    p3 = (joint12[:, :, None] * p3_given_12).sum((0, 1))
    return joint12.sum(0).numpy(), p3.numpy()


def check(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("depth", [1, 3])
def test_speculative_sampling_keeps_target_distribution(models, depth):
    hf, target = models
    drafter_dir = target.path.parent / "a"
    drafter = load_drafter(drafter_dir, target.cfg)
    p2, p3 = exact_marginals(hf)
    counts2, counts3 = np.zeros(V), np.zeros(V)
    drafted = accepted = 0
    for seed in range(DRAWS):
        g = generate(
            target,
            PROMPT,
            1 + max(depth, 2),
            drafter=drafter,
            mtp_depth=depth,
            params=SamplingParams(temperature=1.0, seed=seed),
        )
        counts2[g.tokens[1]] += 1
        counts3[g.tokens[2]] += 1
        m = g.metrics()
        drafted += m["drafted"]
        accepted += m["accepted"]
    assert 0 < accepted < drafted  # both acceptance and resampling are exercised
    assert check(counts2, p2) > 1e-3
    assert check(counts3, p3) > 1e-3


def test_chi_square_detects_a_wrong_distribution(models):
    """The same check rejects draws from the drafter's-style wrong distribution (power check)."""
    hf, _ = models
    p2, _ = exact_marginals(hf)
    wrong = np.roll(p2, 1) * 0.5 + p2 * 0.5
    counts = np.random.default_rng(0).multinomial(DRAWS, wrong)
    assert check(counts.astype(float), p2) < 1e-3

"""Sampling and exact speculative acceptance for the reference engine (CPU, one sequence).

- `probabilities` turns logits into the distribution to sample from: temperature, then top-k,
  top-p, min-p, in the same order and with the same semantics as Hugging Face transformers'
  logits warpers. Temperature 0 means greedy: a one-hot row at the argmax.
- `greedy_accept` verifies k greedy drafts against the target's k+1 logit rows.
- `speculative_accept` verifies k sampled drafts with standard speculative sampling
  (Leviathan et al. 2023, Chen et al. 2023), which leaves the target distribution unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError

__all__ = [
    "SamplingParams",
    "greedy_accept",
    "make_generator",
    "probabilities",
    "sample",
    "speculative_accept",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a next-token distribution. `temperature == 0` means greedy.

    `top_k == 0`, `top_p == 1` and `min_p == 0` each switch that filter off. Invalid values raise
    EdgeMTPError when the object is built (and from `validate()`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise EdgeMTPError with a one-line message naming the bad value and the valid range."""
        # Written as `not (valid)` so that NaN is rejected too.
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise EdgeMTPError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}"
            )
        if math.isinf(self.temperature):
            raise EdgeMTPError(f"temperature must be finite, got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise EdgeMTPError(
                f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}"
            )
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise EdgeMTPError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        if not (isinstance(self.min_p, int | float) and 0 <= self.min_p < 1):
            raise EdgeMTPError(f"min_p must be in [0, 1) (0 turns it off), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise EdgeMTPError(f"seed must be an integer or unset, got {self.seed!r}")


# Top-p first looks at this many most likely tokens, and at more only when their mass falls
# short: a full sort of Gemma 4's 262144 logits costs far more than a top-k of a few hundred.
TOP_P_CANDIDATES = 256


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """Next-token distribution(s) for `logits` [..., V] as float32 [..., V]; rows are independent.

    Greedy (temperature 0): one-hot at the argmax (first index on ties). Otherwise: divide by the
    temperature, keep the top_k highest logits (ties with the k-th kept), keep the smallest set of
    most probable tokens whose mass reaches top_p (at least one), drop tokens whose probability is
    below min_p times the row's largest, and renormalise. -inf logits (masked tokens) get
    probability 0; each row needs at least one finite logit.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scores = logits / params.temperature
    if params.top_k == 0 and params.top_p == 1.0:
        return _drop_below_min_p(scores, params.min_p).softmax(dim=-1)
    rows = scores.reshape(-1, scores.shape[-1])
    out = torch.zeros_like(rows)
    for row, dest in zip(rows, out, strict=True):
        kept = _kept_by_top_k_and_top_p(row, params)
        dest.index_copy_(0, kept, _drop_below_min_p(row[kept], params.min_p).softmax(dim=-1))
    return out.reshape(scores.shape)


def _kept_by_top_k_and_top_p(row: Tensor, params: SamplingParams) -> Tensor:
    """Indices of the tokens of one row [V] that top_k and then top_p keep."""
    if params.top_k > 0:
        kth = torch.topk(row, min(params.top_k, row.numel())).values[-1]
        ids: Tensor | None = (row >= kth).nonzero().squeeze(-1)  # ties with the k-th stay
        candidates = row[ids]
    else:
        ids, candidates = None, row
    if params.top_p == 1.0:
        assert ids is not None
        return ids
    # As transformers' TopPLogitsWarper, which drops every token whose ascending cumulative mass
    # (itself and all less likely tokens) is <= 1 - top_p: in descending order, a token stays
    # while the mass of the tokens before it is < top_p, so the most likely always stays.
    log_total = candidates.logsumexp(dim=0)
    size = candidates.numel()
    k = min(TOP_P_CANDIDATES, size)
    while True:
        values, order = torch.topk(candidates, k)
        mass = (values - log_total).exp()
        before = torch.cat([mass.new_zeros(1), mass.cumsum(dim=0)[:-1]])
        n = max(1, int((before < params.top_p).sum()))
        if n < k or k == size:
            kept = order[:n]
            return kept if ids is None else ids[kept]
        k = min(8 * k, size)


def _drop_below_min_p(scores: Tensor, min_p: float) -> Tensor:
    """`scores` [..., n] with -inf where a token's probability is below min_p times its row's
    largest (the most likely token always stays)."""
    if min_p == 0.0:
        return scores
    probs = scores.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(drop, -math.inf)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with `seed`, or from OS entropy when `seed` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token id per row: probs [V] -> 0-d int64 tensor, probs [N, V] -> [N].

    Rows need not be normalised but must be non-negative with a positive sum. Inverse-CDF
    sampling: one uniform draw per row against the running sum (torch.multinomial is far slower
    on a full vocabulary row); a zero-probability token is never chosen.
    """
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[..., -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device) * total
    # rand < 1, but u can round up to the total; keep it strictly below so that the first index
    # whose running sum exceeds u always exists and has positive probability.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def argmax_rows(logits: Tensor) -> list[int]:
    """Argmax of each row (first index on ties), as torch's. Through numpy: torch's CPU argmax
    has a fixed cost per call that is many times numpy's, paid at every decode step."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.requires_grad:
        logits = logits.detach().reshape(-1, logits.shape[-1]).float()
    return logits.numpy().argmax(axis=-1).tolist()


def greedy_accept(target_logits: Tensor, drafts: list[int]) -> tuple[int, int]:
    """Verify greedy drafts: (n_accepted, next_token).

    target_logits [k+1, V]: row i is the target's prediction after the prefix plus drafts[:i].
    n_accepted is the number of leading drafts equal to the target's argmax of the row before
    them; next_token is the argmax of row n_accepted (the correction, or the bonus token when
    all k were accepted). Greedy decoding with this is token-identical to plain greedy decoding.
    """
    k = len(drafts)
    _check_rows(target_logits, k + 1, "target_logits")
    choices = argmax_rows(target_logits)
    n = 0
    while n < k and drafts[n] == choices[n]:
        n += 1
    return n, choices[n]


def speculative_accept(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Verify sampled drafts with speculative sampling: (n_accepted, next_token).

    target_probs [k+1, V]: row i is the target's distribution (after `probabilities`) given the
    prefix plus drafts[:i]. draft_probs [k, V]: row i is exactly the distribution drafts[i] was
    sampled from (it may be zero outside a subset, as with the clustered head; a greedy drafter
    passes one-hot rows). Draft i is accepted with probability min(1, p_i(d) / q_i(d)); at the
    first rejection the next token is sampled from norm(max(0, p_i - q_i)) (from p_i if that is
    all zero); if all k are accepted the bonus token is sampled from target_probs[k]. The
    emitted tokens are then distributed exactly as sampling from the target one by one.
    """
    k = draft_tokens.shape[0]
    _check_rows(target_probs, k + 1, "target_probs")
    _check_rows(draft_probs, k, "draft_probs")
    n = k
    if k > 0:
        drafts = draft_tokens.long().unsqueeze(-1)
        p = target_probs[:k].float().gather(-1, drafts).squeeze(-1).tolist()
        q = draft_probs.float().gather(-1, drafts).squeeze(-1).tolist()
        u = torch.rand(k, generator=generator, device=target_probs.device).tolist()
        if min(q) <= 0:
            raise ValueError("speculative_accept: a drafted token has zero draft probability")
        # Accept while u < p / q, written without the division: always when p >= q (u < 1),
        # never when p == 0.
        n = 0
        while n < k and u[n] * q[n] < p[n]:
            n += 1
    if n == k:
        return n, int(sample(target_probs[k].float(), generator))
    residual = (target_probs[n].float() - draft_probs[n].float()).clamp_(min=0)
    if not residual.any():
        return n, int(sample(target_probs[n].float(), generator))
    # torch.multinomial normalises the weights: this samples norm(max(0, p_n - q_n)).
    return n, int(sample(residual, generator))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_rows(x: Tensor, rows: int, name: str) -> None:
    if x.dim() != 2 or x.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, V], got {list(x.shape)}")

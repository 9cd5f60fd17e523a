"""Adaptive MTP: each round, the draft depth that maximises expected committed tokens per second.

For depth k the round commits E_k = 1 + sum_{j<=k} prod_{i<=j} a_i tokens on average, where a_i
is the running probability that draft i is accepted given drafts 1..i-1 were; it costs
T_k = k * (one drafter step) + (verifying k+1 rows, with the host's share of the round). Both
come from the rounds this session has run: acceptance as decayed counts with a prior (draft
1's; for a deeper draft, the estimate of the one before it), costs as
the fastest of the recent rounds per verify shape (a static bundle verifies every k >= 1 with
the same method; the reference engine's cost grows with the rows). The policy starts with two
rounds at depth 1 and two at 0 (`WARMUP`), then picks argmax E_k / T_k every round; a depth it
has not measured lately is estimated from the nearest shape measured lately, and measured again
once chosen.

Re-evaluation is built in: every round decays the acceptance counts toward the prior, so a
policy that settled on AR because the drafter disagreed probes a draft again after a while (the
probe costs one slower round in a few hundred; how soon depends on how cheap drafting is here).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from edgemtp.runtime.generate import Step

# Before the model decides: two rounds drafting 1 token (they measure a drafter step and the
# verify shape of k >= 1 rounds on a static bundle) and two AR rounds, alternating. Each shape
# is measured twice because the first call of a shape can carry one-off set-up, and a shape
# known only from that call can lose for good: it is not chosen again to correct it (an
# inflated AR cost can keep the policy drafting, an inflated verify cost can keep an
# always-agreeing drafter at AR). Cheap on purpose: with a drafter that never agrees this is
# nearly the whole cost of adaptive mode.
WARMUP = (1, 0, 1, 0)
HISTORY = 7  # recent samples whose fastest is a cost
# Rounds after which a cost sample no longer counts. Costs drift (the context grows, other apps
# come and go) and only the shape a round runs is measured: with samples of any age, a shape
# left alone kept a cost from another time: AR, last measured in a slow second, looked dearer
# than drafting measured since, so a drafter that never agreed kept being tried. A stale shape
# borrows the cost of the nearest shape measured lately and, if that makes it win, is measured
# again.
MAX_AGE = 16


def expected_committed(acceptance: Iterable[float]) -> float:
    """Tokens a round commits on average, E_k = 1 + sum_j prod_{i<=j} a_i, from the
    acceptance a_1..a_k of each draft given the ones before it were accepted."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


class AdaptiveDepth:
    def __init__(
        self,
        max_depth: int,
        verify_shape: Callable[[int], str],
        *,
        decay: float = 0.98,
        prior_accept: float = 0.5,
        prior_trials: float = 1.0,
    ):
        self.max_depth = max_depth
        self.verify_shape = verify_shape
        # A depth's verify method never changes: asked once here, not at every round (the
        # policy's own time counts against the decode it steers).
        self.shapes = [verify_shape(k) for k in range(max_depth + 1)]
        self.decay = decay
        self.prior = (prior_accept, prior_trials)
        self.trials = [0.0] * (max_depth + 1)  # index i >= 1: draft i was checked
        self.accepts = [0.0] * (max_depth + 1)
        # (round observed, seconds) samples
        self.draft_s: deque[tuple[int, float]] = deque(maxlen=HISTORY)
        self.verify_s: dict[str, deque[tuple[int, float]]] = {}
        self.rounds = 0
        self.last_estimate: dict[int, float] = {}  # depth -> expected tokens/s at the last choice

    # --- the model -----------------------------------------------------------------------------
    def acceptance(self, i: int) -> float:
        """Probability that draft i (1-based) is accepted, given the drafts before it were.
        Draft 1 starts from the prior; draft i > 1 from draft i - 1's estimate (`prior_trials`
        rounds' worth of it): a deeper draft is never assumed worse than the one before it
        until it is measured. With a flat prior for every draft, a deep round priced at
        0.5 x 0.5 x 0.5 can lose to AR before it is ever run, however well the pair agrees."""
        return self.acceptances(i)[-1]

    def acceptances(self, k: int) -> list[float]:
        """`acceptance(i)` for drafts 1..k, each prior computed once."""
        a, t = self.prior
        out: list[float] = []
        for i in range(1, k + 1):
            pseudo = a if i == 1 else out[-1] * t
            out.append((self.accepts[i] + pseudo) / (self.trials[i] + t))
        return out

    def expected_tokens(self, k: int) -> float:
        return expected_committed(self.acceptances(k))

    def _cost(self, samples: Iterable[tuple[int, float]]) -> float | None:
        """The fastest round among the samples younger than MAX_AGE rounds (None if none is):
        other load on the machine and a method's one-off set-up on its first call only ever add
        time. A median let a busy minute make AR look slower than depth 1."""
        fresh = [s for r, s in samples if self.rounds - r < MAX_AGE]
        return min(fresh) if fresh else None

    def draft_cost(self) -> float | None:
        """Seconds of one drafter step: measured lately, else the last samples however old
        (a stale drafter cost must not stop the policy from drafting again)."""
        cost = self._cost(self.draft_s)
        return cost if cost is not None or not self.draft_s else min(s for _, s in self.draft_s)

    def _verify_costs(self) -> list[float | None]:
        """Each depth's verify cost measured lately (None: not lately), one shape at a time."""
        by_shape = {shape: self._cost(v) for shape, v in self.verify_s.items()}
        return [by_shape.get(shape) for shape in self.shapes]

    def verify_cost(self, k: int, costs: list[float | None] | None = None) -> float | None:
        """Seconds of a round's verify part at depth k, measured lately, or an estimate from the
        nearest shape measured lately (verify costs are dominated by weight reads: nearly flat)."""
        costs = self._verify_costs() if costs is None else costs
        measured = [(abs(j - k), cost) for j, cost in enumerate(costs) if cost is not None]
        return min(measured)[1] if measured else None

    def rates(self, limit: int) -> dict[int, float | None]:
        """Expected committed tokens per second at depths 0..limit (None until its costs are
        known), every cost and acceptance computed once."""
        costs, draft = self._verify_costs(), self.draft_cost()
        acceptance = self.acceptances(limit)
        out: dict[int, float | None] = {}
        for k in range(limit + 1):
            verify = self.verify_cost(k, costs)
            if verify is None or (k and draft is None):
                out[k] = None
                continue
            seconds = verify + (k * draft if k and draft is not None else 0.0)
            out[k] = expected_committed(acceptance[:k]) / seconds if seconds > 0 else None
        return out

    def rate(self, k: int) -> float | None:
        """Expected committed tokens per second at depth k (None until its costs are known)."""
        return self.rates(k)[k]

    # --- the policy ----------------------------------------------------------------------------
    def choose(self, limit: int) -> int:
        limit = min(limit, self.max_depth)
        if limit <= 0:
            return 0
        if self.rounds < len(WARMUP):
            return min(WARMUP[self.rounds], limit)
        rates = self.rates(limit)
        self.last_estimate = {k: r for k, r in rates.items() if r is not None}
        if not self.last_estimate:
            return limit
        return max(self.last_estimate, key=lambda k: (self.last_estimate[k], -k))

    def observe(self, step: Step) -> None:
        self.rounds += 1
        self.trials = [t * self.decay for t in self.trials]
        self.accepts = [a * self.decay for a in self.accepts]
        k, n = step.drafted, step.accepted
        for i in range(1, min(n + 1, k) + 1):
            self.trials[i] += 1
        for i in range(1, n + 1):
            self.accepts[i] += 1
        drafting = step.seconds.get("drafter", 0.0)
        if k:
            self.draft_s.append((self.rounds, drafting / k))
        shape = self.shapes[k]
        self.verify_s.setdefault(shape, deque(maxlen=HISTORY)).append(
            (self.rounds, step.seconds["total"] - drafting)
        )

    def summary(self) -> dict[str, object]:
        """What the policy believes now: acceptance by draft position, costs, expected rates."""
        return {
            "acceptance_by_position": [round(a, 4) for a in self.acceptances(self.max_depth)],
            "draft_step_ms": None if (d := self.draft_cost()) is None else 1000 * d,
            "verify_ms": {
                s: 1000 * c
                for s, v in sorted(self.verify_s.items())
                if (c := self._cost(v)) is not None
            },
            "expected_tok_s": {str(k): round(r, 2) for k, r in self.last_estimate.items()},
        }

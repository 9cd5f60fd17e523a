"""The decoding engine: prefill, then AR or MTP rounds, over any backend (`runtime.backends`).

One sequence. The backend owns the target's KV cache; the drafter reads it in place. Each round
drafts k tokens after the last committed one, verifies all k+1 rows in one target forward, keeps
the agreeing prefix plus one token of the target's own, and rolls the cache back past the rest.
`max_new_tokens` counts committed tokens only: the draft depth shrinks near the end of the budget
(and of the context) so drafted tokens never spend it. A depth policy picks k each round: pinned,
or adaptive (`runtime.adaptive`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from edgemtp.model.checkpoint import Drafter, Target
from edgemtp.runtime.backends import PREFILL_CHUNK, Backend, ReferenceBackend
from edgemtp.runtime.sampling import (
    SamplingParams,
    argmax_rows,
    greedy_accept,
    make_generator,
    probabilities,
    sample,
    speculative_accept,
)

DEFAULT_PREFILL_CHUNK = PREFILL_CHUNK
PHASES = ("embed", "target", "drafter", "sampling")


@dataclass
class Step:
    """One prefill or decode round: what it did, what it committed, where its time went."""

    kind: str  # "prefill" | "decode"
    start: int  # position of the first row
    rows: int  # prompt rows (prefill) or rows verified (decode: k + 1)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    # Per phase (embed, target, drafter, sampling, host = the rest) and total: the wall time from
    # the previous tokens reaching the caller to this round's reaching it.
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0  # inputs, outputs and cache rows the host copied


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    i = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[i]


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]
    steps: list[Step]
    t_start: float
    t_first: float
    t_end: float
    # "stop" (a stop token), "length" (the budget), "context" (cache full), "interrupted"
    stop_reason: str
    reused: int = 0  # prompt tokens whose cache was kept from an earlier turn

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    def metrics(self) -> dict[str, object]:
        decode = [s for s in self.steps if s.kind == "decode"]
        prefill_s = sum(s.seconds["total"] for s in self.steps if s.kind == "prefill")
        prefilled = sum(s.rows for s in self.steps if s.kind == "prefill")
        n_out = len(self.tokens)
        decode_span = self.t_end - self.t_first
        drafted, accepted = self.drafted, self.accepted
        # Each round's wall time, shared by the tokens it committed: the pace a reader sees.
        itl = [s.seconds["total"] / s.committed for s in decode for _ in range(s.committed)]
        phases = {p: sum(s.seconds.get(p, 0.0) for s in decode) for p in (*PHASES, "host")}
        return {
            "prompt_tokens": self.prompt_len,
            "reused_prompt_tokens": self.reused,
            "generated_tokens": n_out,
            "ttft_s": self.t_first - self.t_start,
            "prefill_tok_s": prefilled / prefill_s if prefill_s > 0 else None,
            "decode_tok_s": (n_out - 1) / decode_span if n_out > 1 and decode_span > 0 else None,
            "itl_p50_ms": 1000 * statistics.median(itl) if itl else None,
            "itl_p95_ms": 1000 * _percentile(itl, 0.95) if itl else None,  # type: ignore[operator]
            "target_forwards": len(self.steps),
            "decode_forwards": len(decode),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_committed_per_forward": (
                sum(s.committed for s in decode) / len(decode) if decode else None
            ),
            "mtp_depths_used": {
                str(k): n for k, n in sorted(Counter(s.drafted for s in decode).items())
            },
            "bytes_moved_per_step": (
                statistics.mean(s.bytes_moved for s in decode) if decode else None
            ),
            "decode_seconds_by_phase": phases,
        }


class DepthPolicy(Protocol):
    """Chooses each round's draft depth and learns from the rounds it sees."""

    def choose(self, limit: int) -> int: ...

    def observe(self, step: Step) -> None: ...


@dataclass
class FixedDepth:
    depth: int

    def choose(self, limit: int) -> int:
        return min(self.depth, limit)

    def observe(self, step: Step) -> None:
        pass


class _Clock:
    """Turns a backend meter's running totals into one step's phase times and bytes."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.t = time.perf_counter()
        self.seconds, self.bytes = backend.meter.snapshot()

    def step(self, step: Step, sampling: float = 0.0) -> Step:
        now = time.perf_counter()
        seconds, moved = self.backend.meter.snapshot()
        phases = {p: seconds.get(p, 0.0) - self.seconds.get(p, 0.0) for p in PHASES[:3]}
        phases["sampling"] = sampling
        phases["host"] = max(0.0, now - self.t - sum(phases.values()))
        phases["total"] = now - self.t
        step.seconds, step.bytes_moved = phases, moved - self.bytes
        self.t, self.seconds, self.bytes = now, seconds, moved
        return step


def _choose(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.greedy:
        return argmax_rows(logits)[0]
    return int(sample(probabilities(logits, params), gen))


def draft(
    backend: Backend,
    token: int,
    hidden: Tensor,
    position: int,
    depth: int,
    params: SamplingParams,
    gen: torch.Generator,
    vocab: int,
) -> tuple[list[int], Tensor | None, float]:
    """Propose `depth` tokens after `token` (at `position`, not yet in the cache): greedy
    drafts in one call where the backend can (`draft_chain`), else step by step.

    Returns the drafted ids, when sampling their draft distributions [depth, vocab], and the
    seconds spent choosing them.
    """
    if params.greedy:
        chain = getattr(backend, "draft_chain", None)
        drafted = chain(token, hidden, position, depth) if chain is not None else None
        if drafted is not None:
            return drafted, None, 0.0
    tokens: list[int] = []
    dists = []
    choosing = 0.0
    for _ in range(depth):
        hidden, ids, logits = backend.draft_step(token, hidden, position)
        t0 = time.perf_counter()
        if params.greedy:
            best = argmax_rows(logits)[0]
            token = int(ids[best]) if ids is not None else best
        else:
            local = probabilities(logits, params)
            q = torch.zeros(vocab).index_copy_(0, ids, local) if ids is not None else local
            token = int(sample(q, gen))
            dists.append(q)
        tokens.append(token)
        choosing += time.perf_counter() - t0
    return tokens, (torch.stack(dists) if dists else None), choosing


def decode_round(
    backend: Backend,
    token: int,
    hidden: Tensor,
    row: int,
    position: int,
    k: int,
    params: SamplingParams,
    gen: torch.Generator,
) -> tuple[list[int], Tensor, Step]:
    """One round, drafting from `hidden[row]`: (committed tokens, the verified rows' hidden
    states, the step). The next round drafts from row `step.accepted` of them; the row is
    taken only when it drafts (an AR step never needs it, and a tensor op costs here)."""
    drafts, q, choosing = [], None, 0.0
    if k:
        vocab = backend.vocab_size
        drafts, q, choosing = draft(backend, token, hidden[row], position, k, params, gen, vocab)
    logits, rows_hidden = backend.verify([token, *drafts], position)
    t0 = time.perf_counter()
    if params.greedy:
        n, nxt = greedy_accept(logits, drafts)
    else:
        p = probabilities(logits, params)
        drafted = torch.tensor(drafts, dtype=torch.long)
        n, nxt = speculative_accept(p, q if q is not None else p[:0], drafted, gen)
    choosing += time.perf_counter() - t0
    backend.truncate(position + n + 1)  # keeps: at most k positions back, inside every ring
    step = Step("decode", position, k + 1, drafted=k, accepted=n, committed=n + 1)
    step.seconds["sampling"] = choosing
    return [*drafts[:n], nxt], rows_hidden, step


def decode(
    backend: Backend,
    prompt: list[int],
    max_new_tokens: int,
    *,
    policy: DepthPolicy | None = None,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    reused: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` committed tokens after `prompt`, whose first `reused`
    tokens are already in the backend's cache (a chat's earlier turns). `should_stop` is asked
    between rounds, where the cache holds exactly the committed tokens: stopping there keeps
    them (stop reason "interrupted") and the cache consistent."""
    policy = policy or FixedDepth(0)
    params = params or SamplingParams()
    params.validate()
    gen = make_generator(params.seed)
    if not 0 <= reused < len(prompt):
        raise ValueError(f"reused {reused} of a {len(prompt)}-token prompt: one must be new")

    t_start = time.perf_counter()
    clock = _Clock(backend)
    hidden, logits = backend.prefill(prompt[reused:], reused)
    hidden, row = hidden[None], 0  # hidden states of the rows last verified, the one to draft from
    t0 = time.perf_counter()
    out = [_choose(logits, params, gen)]
    prefill = clock.step(Step("prefill", reused, len(prompt) - reused), time.perf_counter() - t0)
    t_first = time.perf_counter()
    steps = [prefill]
    if on_tokens:
        on_tokens(out)
    position = len(prompt)  # where out[-1] goes: committed, not yet in the cache
    stop_reason = "length"
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        if should_stop is not None and should_stop():
            stop_reason = "interrupted"
            break
        room = backend.max_context - position  # rows the cache can still take
        if room < 1:
            stop_reason = "context"
            break
        limit = min(backend.max_draft, max_new_tokens - len(out) - 1, room - 1)
        k = policy.choose(limit) if backend.has_drafter else 0
        committed, hidden, step = decode_round(
            backend, out[-1], hidden, row, position, k, params, gen
        )
        row = step.accepted
        position += len(committed)
        stops = [i for i, t in enumerate(committed) if t in stop_ids]
        if stops:  # tokens after a stop were committed to the cache: forget them
            position -= len(committed) - stops[0] - 1
            committed = committed[: stops[0] + 1]
            backend.truncate(position)
        out.extend(committed)
        if on_tokens:
            on_tokens(committed)
        steps.append(clock.step(step, step.seconds["sampling"]))
        policy.observe(step)
    t_end = time.perf_counter()
    if out[-1] in stop_ids:
        stop_reason = "stop"
    return Generation(len(prompt), out, steps, t_start, t_first, t_end, stop_reason, reused)


def generate(
    target: Target,
    prompt: list[int],
    max_new_tokens: int,
    *,
    drafter: Drafter | None = None,
    mtp_depth: int | None = None,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    prune: bool = True,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    max_context: int | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    kv_cache: str | None = None,
) -> Generation:
    """The reference engine in one call: a fresh `ReferenceBackend` sized for this generation,
    depth `mtp_depth` (default 2 with a drafter, else 0)."""
    depth = (2 if drafter is not None else 0) if mtp_depth is None else mtp_depth
    if depth and drafter is None:
        raise ValueError("MTP needs a drafter")
    needed = len(prompt) + max_new_tokens + depth + 1
    backend = ReferenceBackend(
        target,
        drafter,
        max_context=max_context or needed,
        max_draft=depth,
        prefill_chunk=prefill_chunk,
        prune=prune,
        kv_cache=kv_cache,
    )
    return decode(
        backend,
        prompt,
        max_new_tokens,
        policy=FixedDepth(depth),
        params=params,
        stop_ids=stop_ids,
        on_tokens=on_tokens,
    )

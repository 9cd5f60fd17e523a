"""The reference decoding engine: chunked prefill with KV-shared-layer pruning, AR and MTP decoding.

One sequence. The target owns the KV cache; the drafter reads it in place. `max_new_tokens`
counts committed tokens only: the draft depth shrinks near the end of the budget so drafted tokens
never spend it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from edgemtp.model.checkpoint import Drafter, Target
from edgemtp.runtime.kv_cache import KVCache
from edgemtp.runtime.sampling import (
    SamplingParams,
    greedy_accept,
    make_generator,
    probabilities,
    sample,
    speculative_accept,
)

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Step:
    """One target forward (a prefill chunk or a decode round) and what it committed."""

    kind: str  # "prefill" | "decode"
    start: int  # position of the first row
    rows: int  # rows through the non-shared layers
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: draft, verify, accept, ...


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]
    steps: list[Step]
    t_start: float
    t_first: float
    t_end: float
    stop_reason: str

    def metrics(self) -> dict[str, float | int | None]:
        decode = [s for s in self.steps if s.kind == "decode"]
        prefill_s = sum(sum(s.seconds.values()) for s in self.steps if s.kind == "prefill")
        n_out = len(self.tokens)
        decode_span = self.t_end - self.t_first
        drafted = sum(s.drafted for s in decode)
        accepted = sum(s.accepted for s in decode)
        return {
            "prompt_tokens": self.prompt_len,
            "generated_tokens": n_out,
            "ttft_s": self.t_first - self.t_start,
            "prefill_tok_s": self.prompt_len / prefill_s if prefill_s > 0 else None,
            "decode_tok_s": (n_out - 1) / decode_span if n_out > 1 and decode_span > 0 else None,
            "target_forwards": len(self.steps),
            "decode_forwards": len(decode),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_committed_per_forward": (
                sum(s.committed for s in decode) / len(decode) if decode else None
            ),
        }


def prefill(
    target: Target,
    cache: KVCache,
    ids: Tensor,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    prune: bool = True,
    steps: list[Step] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the prompt through the target in chunks; returns (last hidden [hidden], last logits).

    Pruned: intermediate chunks skip the KV-shared layers (they write no cache), the final chunk
    sends only its last row through them.
    """
    model, tables = target.model, target.tables
    n = ids.shape[0]
    hidden = None
    for start in range(0, n, chunk):
        t0 = time.perf_counter()
        part = ids[start : start + chunk]
        last = start + chunk >= n
        rows = ("last" if last else "none") if prune else "all"
        positions = torch.arange(cache.length, cache.length + part.shape[0])
        embeds = tables.embed(part)
        hidden, new_kv = model(embeds, tables.per_layer_inputs(part), positions, cache, rows)
        cache.write(new_kv, int(positions[0]))
        if steps is not None:
            steps.append(
                Step(
                    "prefill",
                    int(positions[0]),
                    part.shape[0],
                    seconds={"forward": time.perf_counter() - t0},
                )
            )
    assert hidden is not None
    last_hidden = hidden[-1]
    return last_hidden, model.logits(last_hidden)


def _choose(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(sample(probabilities(logits, params), gen))


def draft(
    target: Target,
    drafter: Drafter,
    cache: KVCache,
    token: int,
    hidden: Tensor,
    position: int,
    depth: int,
    params: SamplingParams,
    gen: torch.Generator,
) -> tuple[list[int], Tensor | None]:
    """Propose `depth` tokens after `token` (at `position`, not yet in the cache).

    Returns the drafted ids and, when sampling, their draft distributions [depth, vocab].
    """
    vocab = target.cfg.vocab_size
    tokens: list[int] = []
    dists = []
    for _ in range(depth):
        embed = target.tables.embed(torch.tensor([token]))[0]
        hidden, ids, logits = drafter.model(embed, hidden, position, cache)
        if params.greedy:
            token = int(ids[logits.argmax()]) if ids is not None else int(logits.argmax())
        else:
            local = probabilities(logits, params)
            q = torch.zeros(vocab).index_copy_(0, ids, local) if ids is not None else local
            token = int(sample(q, gen))
            dists.append(q)
        tokens.append(token)
    return tokens, torch.stack(dists) if dists else None


def decode_round(
    target: Target,
    drafter: Drafter | None,
    cache: KVCache,
    token: int,
    hidden: Tensor,
    position: int,
    k: int,
    params: SamplingParams,
    gen: torch.Generator,
) -> tuple[list[int], Tensor, Step]:
    """Draft k tokens after `token`, verify all k+1 rows in one target forward, keep the agreeing
    prefix plus one token of the target's own, and roll the cache back past the rest.

    Returns (committed tokens, the hidden state to draft from next, the step's trace).
    """
    t0 = time.perf_counter()
    drafts, q = ([], None)
    if k:
        drafts, q = draft(target, drafter, cache, token, hidden, position, k, params, gen)
    t1 = time.perf_counter()
    ids = torch.tensor([token, *drafts])
    positions = torch.arange(position, position + k + 1)
    tables = target.tables
    rows_hidden, new_kv = target.model(
        tables.embed(ids), tables.per_layer_inputs(ids), positions, cache, "all"
    )
    cache.write(new_kv, position)
    logits = target.model.logits(rows_hidden)
    t2 = time.perf_counter()
    drafted = torch.tensor(drafts, dtype=torch.long)
    if params.greedy:
        n, nxt = greedy_accept(logits, drafted)
    else:
        p = probabilities(logits, params)
        n, nxt = speculative_accept(p, q if q is not None else p[:0], drafted, gen)
    cache.truncate(position + n + 1)
    seconds = {"draft": t1 - t0, "verify": t2 - t1, "accept": time.perf_counter() - t2}
    step = Step("decode", position, k + 1, drafted=k, accepted=n, committed=n + 1, seconds=seconds)
    return [*drafts[:n], nxt], rows_hidden[n], step


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
) -> Generation:
    """Generate up to `max_new_tokens` committed tokens after `prompt`."""
    depth = (2 if drafter is not None else 0) if mtp_depth is None else mtp_depth
    if depth and drafter is None:
        raise ValueError("MTP needs a drafter")
    params = params or SamplingParams()
    params.validate()
    gen = make_generator(params.seed)
    needed = len(prompt) + max_new_tokens + depth + 1
    context = max_context or min(target.cfg.max_position_embeddings, needed)
    cache = KVCache(target.cfg, context, max_draft=depth)
    steps: list[Step] = []

    t_start = time.perf_counter()
    hidden, logits = prefill(target, cache, torch.tensor(prompt), prefill_chunk, prune, steps)
    out = [_choose(logits, params, gen)]
    t_first = time.perf_counter()
    if on_tokens:
        on_tokens(out)
    position = len(prompt)  # where out[-1] goes: committed, not yet in the cache

    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        k = min(depth, max_new_tokens - len(out) - 1)  # drafts never spend the budget
        committed, hidden, step = decode_round(
            target, drafter, cache, out[-1], hidden, position, k, params, gen
        )
        position += len(committed)
        stops = [i for i, t in enumerate(committed) if t in stop_ids]
        committed = committed[: stops[0] + 1] if stops else committed
        out.extend(committed)
        steps.append(step)
        if on_tokens:
            on_tokens(committed)
    t_end = time.perf_counter()
    stop_reason = "stop" if out[-1] in stop_ids else "length"
    return Generation(len(prompt), out, steps, t_start, t_first, t_end, stop_reason)

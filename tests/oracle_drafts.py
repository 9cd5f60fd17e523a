"""Test helpers over a bundle's `StaticBackend`: greedy decoding with the one engine, and a
backend whose drafts are known: the reference's greedy continuation, corrupted at every third
position, so decoding rounds accept 0, 1 or 2 drafts and the implicit rollback of the static
cache runs in every pattern."""

from __future__ import annotations

import torch

from edgemtp.runtime.backends import Backend, StaticBackend
from edgemtp.runtime.generate import FixedDepth, Generation, decode


def greedy(backend: Backend, prompt: list[int], n: int, depth: int = 0) -> Generation:
    """Greedy decoding from an empty cache at a pinned depth; `.calls`: the methods it called."""
    backend.truncate(0)
    calls = getattr(backend, "calls", {})
    calls.clear()
    result = decode(backend, prompt, n, policy=FixedDepth(depth))
    result.calls = dict(calls)  # type: ignore[attr-defined]
    return result


class OracleDrafts(StaticBackend):
    def __init__(self, *args, ar_tokens: list[int], prompt_len: int, **kw):
        super().__init__(*args, **kw)
        self.ar, self.prompt_len = ar_tokens, prompt_len
        self.has_drafter = True
        self.corrupt = True  # False: always the reference's continuation
        self.drafted_in_round = 0

    def verify(self, ids, position):
        self.drafted_in_round = 0
        return super().verify(ids, position)

    def draft_chain(self, token, hidden, position, depth):
        return None  # its drafts are the oracle's, step by step

    def draft_step(self, token, hidden, position):
        j, i = position - self.prompt_len, self.drafted_in_round
        self.drafted_in_round += 1
        t = self.ar[j + 1 + i] if j + 1 + i < len(self.ar) else 0
        t = (t + 1) % 512 if self.corrupt and (j + i) % 3 == 0 else t
        return hidden, torch.tensor([t]), torch.zeros(1)


class WholeCacheCheck:
    """A runner that runs every context-bucketed decode call through the whole-cache method as
    well (same positions: the same K/V written twice) and keeps the largest difference of their
    outputs, relative to the largest output. Prefill chunks run once: a chunk that wraps a
    sliding ring overwrites keys that a second run of it would still read."""

    def __init__(self, runner):
        self.runner, self.shapes, self.methods = runner, runner.shapes, runner.methods
        self.worst = 0.0

    def call(self, method: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if "_ctx" not in method or method.startswith("prefill"):
            return self.runner.call(method, *inputs)
        whole = self.runner.call(method.split("_ctx")[0], *inputs)
        got = self.runner.call(method, *inputs)
        for a, b in zip(whole, got, strict=True):
            scale = max(a.float().abs().max().item(), 1e-6)
            self.worst = max(self.worst, (a.float() - b.float()).abs().max().item() / scale)
        return got

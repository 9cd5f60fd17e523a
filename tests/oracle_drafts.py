"""A static driver whose drafts are known: the reference's greedy continuation, corrupted at every
third position, so decoding rounds accept 0, 1 or 2 drafts and the implicit rollback of the
static cache runs in every pattern."""

from __future__ import annotations

from edgemtp.export.driver import StaticDriver


class OracleDrafts(StaticDriver):
    def __init__(self, *args, ar_tokens: list[int], prompt_len: int, **kw):
        super().__init__(*args, **kw)
        self.ar, self.prompt_len = ar_tokens, prompt_len

    def draft(self, token: int, hidden, position: int, depth: int) -> list[int]:
        j = position - self.prompt_len
        out = []
        for i in range(depth):
            t = self.ar[j + 1 + i] if j + 1 + i < len(self.ar) else 0
            out.append((t + 1) % 512 if (j + i) % 3 == 0 else t)
        return out

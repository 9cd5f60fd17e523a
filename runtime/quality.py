"""What quantization cost: next-token KL divergence, top-1 agreement and perplexity on a text,
per-tensor weight error, and MTP acceptance before and after. Table plus a PNG plot."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edgemtp.model.cache import KVCache
from edgemtp.model.checkpoint import Drafter, Target, TensorSource
from edgemtp.quantize.checkpoint import is_linear, is_table
from edgemtp.runtime.generate import generate

_ROW_CHUNK = 8192


@dataclass
class Report:
    tokens: int
    kl_mean: float
    top1_agreement: float
    ppl_float: float
    ppl_quantized: float
    weight_error: dict[str, float] = field(default_factory=dict)  # ||W - Wq|| / ||W||
    acceptance_float: float | None = None
    acceptance_quantized: float | None = None

    def table(self) -> str:
        rows = [
            ("tokens scored", f"{self.tokens}"),
            ("KL(float || quantized), mean nats/token", f"{self.kl_mean:.5f}"),
            ("top-1 agreement", f"{self.top1_agreement:.2%}"),
            ("perplexity float", f"{self.ppl_float:.3f}"),
            ("perplexity quantized", f"{self.ppl_quantized:.3f}"),
        ]
        if self.weight_error:
            worst = max(self.weight_error, key=self.weight_error.__getitem__)
            mean = sum(self.weight_error.values()) / len(self.weight_error)
            rows.append(("weight error, mean over tensors", f"{mean:.4f}"))
            rows.append(("weight error, worst", f"{self.weight_error[worst]:.4f} ({worst})"))
        if self.acceptance_float is not None:
            rows.append(("MTP acceptance float pair", f"{self.acceptance_float:.2%}"))
            rows.append(("MTP acceptance quantized pair", f"{self.acceptance_quantized:.2%}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def next_token_stats(
    reference: Target, quantized: Target, ids: list[int], window: int = 256
) -> tuple[int, float, float, float, float]:
    """(tokens, mean KL, top-1 agreement, float perplexity, quantized perplexity) over `ids`,
    scored in independent windows of `window` tokens."""
    n = kl = agree = nll_f = nll_q = 0.0
    for start in range(0, len(ids) - 1, window):
        part = torch.tensor(ids[start : start + window + 1])
        if len(part) < 2:
            break
        inputs, labels = part[:-1], part[1:]
        logp = []
        for target in (reference, quantized):
            tables = target.tables
            hidden, _ = target.model(
                tables.embed(inputs),
                tables.per_layer_inputs(inputs),
                torch.arange(len(inputs)),
                KVCache(target.cfg, len(inputs)),
                "all",
            )
            logp.append(torch.log_softmax(target.model.logits(hidden).double(), dim=-1))
        f, q = logp
        kl += float((f.exp() * (f - q)).sum())
        agree += float((f.argmax(-1) == q.argmax(-1)).sum())
        nll_f -= float(f.gather(1, labels[:, None]).sum())
        nll_q -= float(q.gather(1, labels[:, None]).sum())
        n += len(inputs)
    if n == 0:
        raise ValueError("the report text needs at least two tokens")
    return int(n), kl / n, agree / n, math.exp(nll_f / n), math.exp(nll_q / n)


def weight_errors(reference: TensorSource, quantized: TensorSource) -> dict[str, float]:
    """Relative RMS error of every quantized weight (tables compared in row chunks)."""
    errors = {}
    present = set(quantized.names())
    for name in reference.names():
        shape = tuple(reference.raw(name).shape)
        if not (is_linear(name, shape) or is_table(name)) or name not in present:
            continue
        err = norm = 0.0
        if is_table(name):
            ref_rows, q_rows = reference.table(name), quantized.table(name)
            for start in range(0, shape[0], _ROW_CHUNK):
                ids = torch.arange(start, min(start + _ROW_CHUNK, shape[0]))
                w = ref_rows[ids].double()
                err += float((w - q_rows[ids].double()).pow(2).sum())
                norm += float(w.pow(2).sum())
        else:
            w = reference.tensor(name).double()
            err = float((w - quantized.tensor(name).double()).pow(2).sum())
            norm = float(w.pow(2).sum())
        errors[name] = math.sqrt(err / max(norm, 1e-300))
    return errors


def acceptance(
    target: Target, drafter: Drafter, prompts: list[list[int]], new_tokens: int
) -> float:
    drafted = accepted = 0
    for prompt in prompts:
        m = generate(target, prompt, new_tokens, drafter=drafter, mtp_depth=2).metrics()
        drafted += m["drafted"]
        accepted += m["accepted"]
    return accepted / drafted if drafted else 0.0


def build_report(
    reference: Target,
    quantized: Target,
    ids: list[int],
    drafters: tuple[Drafter, Drafter] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    say = progress or (lambda _msg: None)
    say(f"scoring {len(ids)} tokens with both models")
    n, kl, agree, ppl_f, ppl_q = next_token_stats(reference, quantized, ids)
    say("comparing weights")
    report = Report(n, kl, agree, ppl_f, ppl_q, weight_errors(reference.source, quantized.source))
    if drafters is not None:
        say("measuring MTP acceptance")
        prompts = [
            ids[i : i + 32] for i in range(0, min(len(ids), 4 * 32), 32) if len(ids[i:]) >= 8
        ]
        report.acceptance_float = acceptance(reference, drafters[0], prompts, 48)
        report.acceptance_quantized = acceptance(quantized, drafters[1], prompts, 48)
    return report


def plot_weight_error(report: Report, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    others: dict[str, float] = {}
    for name, err in report.weight_error.items():
        m = re.search(r"layers\.(\d+)\.(?:\w+\.)?(\w+)\.weight$", name)
        if m:
            series.setdefault(m.group(2), {})[int(m.group(1))] = err
        else:
            others[name.removeprefix("model.").removesuffix(".weight")] = err
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 1])
    for kind, points in sorted(series.items()):
        xs = sorted(points)
        left.plot(xs, [points[x] for x in xs], marker="o", markersize=3, label=kind)
    left.set_xlabel("layer")
    left.set_ylabel("||W - Wq|| / ||W||")
    left.legend(fontsize=7, ncol=2)
    right.barh(list(others), list(others.values()))
    right.tick_params(axis="y", labelsize=7)
    right.set_xlabel("relative error")
    fig.suptitle(
        f"{title}: KL {report.kl_mean:.4f} nats/token, top-1 {report.top1_agreement:.1%}, "
        f"ppl {report.ppl_float:.2f} -> {report.ppl_quantized:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

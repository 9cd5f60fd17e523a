"""Decode attention over a long cache: the form XNNPACK programs use against the alternatives.

    OMP_NUM_THREADS=1 python benchmarks/attention_forms.py [--slots 512,2048,4096] [--repeat 9]
        [--threads 1] [--idle-us 0]

One decode row of a full-attention layer (`--heads` query heads over one KV head of
`--head-dim`: PEER-90M's full layers are 4 x 256) against a cache of N slots, every slot
attended. Each form is lowered into one ExecuTorch program with XNNPACK (the cache passed in,
as the static programs' cache buffers are, never a constant XNNPACK could pack once) and timed
in this process, interleaved, medians of `--repeat` rounds:

- `bmm`: what the programs run (`exportable.segment_attention`: batched matmuls, an additive
  mask, one softmax);
- `fc`: the cache as a fully-connected input and the query (then the probabilities) as its
  dynamic weights, values stored transposed;
- `custom_sdpa`: ExecuTorch's own `llama::custom_sdpa` (its LLM custom ops, in the wheel), which
  reads only the cache's valid prefix;
- `kernel`: edgemtp's own ExecuTorch kernel (`runtime/kernels/cache_attention.cpp`, what
  `--kernels edgemtp` programs call for decode, verify and draft rows), and `kernel_fp16`: the
  same over a float16 cache, as kernel bundles store it (checked against eager attention over
  the float16 values);
- `eager`: the same batched matmuls in eager PyTorch (MKL), as a reference for the hardware.

`--idle-us N` keeps the calling thread busy N µs before each call (not timed), as a decode
step's other work sits between two kernels: with more than one thread the pool's worker has then
gone to sleep when a call starts (`threadpool_wake.py`), as it has in a step.

Every form's output is checked against the eager one. Writes OUT/attention_forms.{json,md,png}.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import RESULTS, machine, pyplot, save_figure, write_results
from torch import Tensor, nn

from edgemtp.export.executorch_program import (
    backend_config,
    export_method,
    lower_programs,
    xnnpack_partitioner,
)
from edgemtp.runtime.kernels.ops import segment_attention

CALLS = 200  # per timing round


class Bmm(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return segment_attention(q, (k,), (v,), mask, q.shape[1])


class CacheAsInput(nn.Module):
    def forward(self, q: Tensor, k: Tensor, vt: Tensor, mask: Tensor) -> Tensor:
        scores = F.linear(k[0], q[0]).t() + mask  # [heads, slots]
        return F.linear(vt[0], torch.softmax(scores, dim=-1)).t()[None]


class CustomSdpa(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, last: Tensor) -> Tensor:
        start = last[0].item()  # the row's position: keys 0..start are read
        torch._check(start >= 0)
        torch._check(start < k.shape[1])
        # [batch, rows, heads, head_dim]: one row of every query head, the cache's one KV head
        out = torch.ops.llama.custom_sdpa(q[None], k[:, :, None], v[:, :, None], start,
                                          None, 0.0, False, 1.0)  # fmt: skip
        return out[0]


class Kernel(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return torch.ops.edgemtp.cache_attention(q, k, v, None, None, mask)


def eager(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)


def busy(us: float) -> None:
    """Keep the calling thread working for `us` µs (not sleeping: as a decode step's delegate
    call or portable operator keeps it between two kernels, while the pool's worker idles)."""
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


def measure(
    slots: int, heads: int, head_dim: int, repeat: int, idle_us: float = 0.0
) -> dict[str, Any]:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama::custom_sdpa)
    from executorch.extension.pybindings import portable_lib

    gen = torch.Generator().manual_seed(slots)
    q = torch.randn(1, heads, head_dim, generator=gen)
    k = torch.randn(1, slots, head_dim, generator=gen)
    v = torch.randn(1, slots, head_dim, generator=gen)
    mask, last = torch.zeros(1, slots), torch.tensor([slots - 1])
    inputs = {
        "bmm": (Bmm(), (q, k, v, mask)),
        "fc": (CacheAsInput(), (q, k, v.transpose(1, 2).contiguous(), mask)),
        "custom_sdpa": (CustomSdpa(), (q, k, v, last)),
        "kernel": (Kernel(), (q, k, v, mask)),
        "kernel_fp16": (Kernel(), (q, k.half(), v.half(), mask)),
    }
    programs = {name: export_method(m, args) for name, (m, args) in inputs.items()}
    manager = lower_programs(programs, lambda: [xnnpack_partitioner()]).to_executorch(
        backend_config()
    )
    buffer = manager.buffer
    program = portable_lib._load_for_executorch_from_buffer(buffer)
    ref = eager(q, k, v)
    ref_fp16 = eager(q, k.half().float(), v.half().float())  # what a float16 cache holds
    calls = {name: (lambda n=name: program.run_method(n, inputs[n][1])) for name in inputs}
    calls["eager"] = lambda: eager(q, k, v)
    errors = {}
    for name, call in calls.items():
        out = call()
        out = out[0] if isinstance(out, (list, tuple)) else out
        errors[name] = float((out - (ref_fp16 if name == "kernel_fp16" else ref)).abs().max())
        assert errors[name] < 1e-3, (name, errors[name])
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            spent = 0.0
            for _ in range(CALLS):
                busy(idle_us)
                start = time.perf_counter()
                call()
                spent += time.perf_counter() - start
            samples[name].append(spent / CALLS * 1e6)
    return {
        "slots": slots,
        "cache_bytes": 2 * slots * head_dim * 4,
        "us": {name: statistics.median(s) for name, s in samples.items()},
        "samples_us": samples,
        "max_abs_error": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", default="512,2048,4096")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument(
        "--idle-us",
        type=float,
        default=0.0,
        help="busy the calling thread this long before each call (a step's work between kernels)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from executorch.extension.pybindings import portable_lib

    from edgemtp.runtime import kernels

    kernels.load()
    torch.set_num_threads(args.threads)
    portable_lib._unsafe_reset_threadpool(args.threads)
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        rows.append(measure(slots, args.heads, args.head_dim, args.repeat, args.idle_us))
        print(f"{slots} slots: " + ", ".join(f"{n} {u:.1f} us" for n, u in rows[-1]["us"].items()))
    command = "python benchmarks/attention_forms.py " + shlex.join(sys.argv[1:])
    forms = list(rows[0]["us"])
    lines = [
        "# Decode attention over a long cache: XNNPACK forms against the alternatives",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}; {machine(args.threads)['cpu']}, "
        f"{args.threads} thread(s)). One row of {args.heads} query heads over one KV head of "
        f"{args.head_dim}, every slot attended; µs per call, medians of {args.repeat} rounds "
        f"of {CALLS} calls, interleaved"
        + (
            f", the calling thread busy {args.idle_us:g} µs before each call"
            if args.idle_us
            else ""
        )
        + ".",
        "",
        "| slots | K+V MiB | " + " | ".join(forms) + " | bmm GB/s |",
        "|---:|---:|" + "---:|" * len(forms) + "---:|",
    ]
    for r in rows:
        rate = r["cache_bytes"] / r["us"]["bmm"] / 1e3
        lines.append(
            f"| {r['slots']} | {r['cache_bytes'] / 2**20:.1f} | "
            + " | ".join(f"{r['us'][f]:.1f}" for f in forms)
            + f" | {rate:.1f} |"
        )
    lines.append("")
    text = "\n".join(lines)
    payload = {"command": command, "machine": machine(args.threads), "rows": rows}
    write_results(args.out / "attention_forms", payload, text, partial(plot, rows, args))
    print(text)
    return 0


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for form in rows[0]["us"]:
        ax.plot([r["slots"] for r in rows], [r["us"][form] for r in rows], "o-", label=form)
    ax.set_xlabel("cache slots attended")
    ax.set_ylabel("µs per decode row")
    ax.set_title(f"decode attention, {args.heads} heads x {args.head_dim}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

"""Adaptive MTP against plain AR and every pinned depth, on one bundle, side by side.

MTP's most reported failure is being slower than AR when the drafter disagrees (a mismatched or
random drafter, an unusual domain). `--mtp auto` must then end within noise of AR. This script
runs one bundle (or checkpoint pair) with `mtp=0`, `auto` and each pinned depth 1..K on the same
prompt, interleaved within each repeat (AR, auto, 1, 2, ... then again), each run from an empty
cache and, for auto, a fresh depth policy that knows nothing yet, and reports the median decode
tok/s of each with the ratio to AR, the depths auto used, and the acceptance.

Usage:
  python benchmarks/adaptive_mtp.py --bundle BUNDLE [--repeat 5] [--tokens 128] [--prompt 64]
  python benchmarks/adaptive_mtp.py --model TARGET --drafter DRAFTER ...   (reference engine)
Writes benchmarks/results/adaptive_mtp[_NAME].{json,md,png} (`--name`).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from harness import RESULTS, pyplot, save_figure, write_results

from edgemtp.runtime.adaptive import AdaptiveDepth
from edgemtp.runtime.session import Session


def open_session(args: argparse.Namespace) -> Session:
    if args.bundle:
        return Session.from_bundle(args.bundle, threads=args.threads, verify=False)
    return Session.from_checkpoints(args.model, args.drafter, max_context=1024, max_draft=4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path)
    src.add_argument("--model", type=Path)
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    first = open_session(args)
    modes: list[int | str] = [0, "auto", *range(1, first.backend.max_draft + 1)]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, first.backend.vocab_size, (args.prompt,), generator=gen).tolist()
    first.generate(prompt, 16, mtp=0, stop_ids=())  # warm-up: first calls, page faults
    runs: list[dict] = []
    session = first
    for repeat in range(args.repeat):
        for mode in modes:
            session.reset()
            if session.adaptive is not None:  # auto starts from nothing in every run
                session.adaptive = AdaptiveDepth(
                    session.backend.max_draft, session.backend.verify_shape
                )
            with torch.no_grad():
                result = session.generate(prompt, args.tokens, mtp=mode, stop_ids=())
            m = result.metrics()
            runs.append(
                {
                    "repeat": repeat,
                    "mode": str(mode),
                    "decode_tok_s": m["decode_tok_s"],
                    "tokens": result.tokens,
                    "mtp_depths_used": m["mtp_depths_used"],
                    "acceptance_rate": m["acceptance_rate"],
                    "mean_committed_per_forward": m["mean_committed_per_forward"],
                }
            )
            print(f"repeat {repeat} mtp={mode}: {m['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    ar_tokens = runs[0]["tokens"]
    summary = {}
    for mode in map(str, modes):
        mine = [r for r in runs if r["mode"] == mode]
        depths: dict[str, int] = {}
        for r in mine:
            for k, n in r["mtp_depths_used"].items():
                depths[k] = depths.get(k, 0) + n
        summary[mode] = {
            "median_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
            "runs_tok_s": [r["decode_tok_s"] for r in mine],
            "depths_used": depths,
            "acceptance_rate": statistics.mean(r["acceptance_rate"] or 0.0 for r in mine),
            "same_tokens_as_ar": all(r["tokens"] == ar_tokens for r in mine),
        }
    ar = summary["0"]["median_tok_s"]
    source = str(args.bundle or f"{args.model} + {args.drafter}")
    suffix = f"_{args.name}" if args.name else ""
    command = " ".join(["python", "benchmarks/adaptive_mtp.py", *sys.argv[1:]])
    lines = [
        f"# Adaptive MTP vs AR and pinned depths: {source}",
        "",
        f"Run {datetime.date.today()}; prompt {args.prompt} tokens, {args.tokens} generated, "
        f"greedy, {args.threads} thread(s), median of {args.repeat} interleaved runs, each in "
        "a fresh session.",
        "",
        "| mtp | decode tok/s (median) | vs AR | acceptance | depth x rounds | tokens = AR |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        used = ", ".join(f"{k}x{n}" for k, n in sorted(s["depths_used"].items()))
        lines.append(
            f"| {mode} | {s['median_tok_s']:.2f} | {s['median_tok_s'] / ar:.3f} "
            f"| {s['acceptance_rate']:.3f} | {used} | {s['same_tokens_as_ar']} |"
        )
    lines += ["", "## Command", "", f"```bash\n{command}\n```", ""]
    text = "\n".join(lines)
    result = {"source": source, "summary": summary, "runs": runs}
    write_results(RESULTS / f"adaptive_mtp{suffix}", result, text, partial(plot, summary, source))
    print(text)
    return 0


def plot(summary: dict, source: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = list(summary)
    ax.bar(names, [summary[n]["median_tok_s"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.plot([i] * len(summary[n]["runs_tok_s"]), summary[n]["runs_tok_s"], "k.", ms=3)
    ax.axhline(summary["0"]["median_tok_s"], color="k", ls="--", lw=1, label="AR median")
    ax.set_xlabel("--mtp")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"adaptive vs pinned depth ({Path(source).name})", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

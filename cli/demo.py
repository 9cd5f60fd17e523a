"""`edgemtp demo`: the embedded pair exported on first run, MTP against AR on it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgemtp.cli.common import check_positive, say


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="export the embedded pair (first run) and compare MTP with AR on it"
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--tokens", type=int, default=128, help="tokens per run")
    p.add_argument("--repeat", type=int, default=5, help="runs of each prompt (median)")
    p.add_argument("--depth", type=int, default=3, help="MTP depth")
    p.add_argument("--out", type=Path, help="bundle folder (default: a cache under ~/.cache)")
    p.add_argument("--target", type=Path, help=argparse.SUPPRESS)  # another pair (tests)
    p.add_argument("--drafter", type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from edgemtp.runtime.demo import ASSISTANT, TARGET, DemoSettings
    from edgemtp.runtime.demo import run_demo as demo

    check_positive("--tokens", args.tokens, 2)
    check_positive("--repeat", args.repeat)
    check_positive("--depth", args.depth)
    settings = DemoSettings(depth=args.depth, tokens=args.tokens, repeat=args.repeat)
    # progress goes to stderr also with --json
    result = demo(args.target or TARGET, args.drafter or ASSISTANT, args.out, settings, say)
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["prompt"] + result["text"])
    print(
        f"\nAR  {result['ar_decode_tok_s']:7.1f} tok/s\n"
        f"MTP {result['mtp_decode_tok_s']:7.1f} tok/s (depth {result['depth']}): "
        f"{result['speedup']:.2f}x, {result['mean_committed_per_forward']:.2f} tokens per "
        f"target forward; MTP tokens equal AR's in {result['mtp_runs_equal_ar']} of "
        f"{result['runs'] * result['prompts']} runs\n"
        f"medians of {result['runs']} runs x {result['prompts']} prompts x "
        f"{result['tokens_per_run']} tokens; bundle: {result['bundle']}"
    )
    for mode, phases in result["decode_ms_per_token_by_phase"].items():
        split = ", ".join(f"{phase} {ms:.3f}" for phase, ms in phases.items() if ms)
        print(f"{mode.upper():3} ms per token: {split}")
    return 0

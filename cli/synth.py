"""`edgemtp synth`: a random-weight checkpoint with real Gemma 4 shapes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from edgemtp.model.synth import PRESETS

    p = sub.add_parser("synth", help="write a random-weight checkpoint with real Gemma 4 shapes")
    p.add_argument("--preset", required=True, choices=PRESETS)
    p.add_argument("--scale", type=float, default=1.0, help="shrink width and depth (0 < F <= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")


def run(args: argparse.Namespace) -> int:
    from edgemtp.model.synth import write_preset

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    out = write_preset(
        args.preset,
        args.out,
        scale=args.scale,
        seed=args.seed,
        dtype=args.dtype,
        init_std=args.init_std,
        progress=progress,
        overwrite=args.force,
    )
    print(out)
    return 0

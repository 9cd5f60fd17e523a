"""`edgemtp distill` and `edgemtp train-target`: their options live with their code in train/."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from edgemtp.train.distill import add_arguments

    add_arguments(
        sub.add_parser(
            "distill", help="train an MTP assistant for any Gemma 4 target from its own outputs"
        )
    )
    p = sub.add_parser(
        "train-target",
        help="pre-train the embedded Gemma 4 target on this CPU (edgemtp train-target --help)",
        add_help=False,
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)  # parsed by train/pretrain.py


def run_distill(args: argparse.Namespace) -> int:
    import shlex

    from edgemtp.train.distill import run_distill as distill

    return distill(args, "edgemtp " + shlex.join(sys.argv[1:]))


def run_train_target(argv: list[str]) -> int:
    from edgemtp.train.pretrain import main as pretrain

    return pretrain(argv)

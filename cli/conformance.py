"""`edgemtp conformance`: greedy decode decisions on a bundle, for apps/core to replay."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgemtp.cli.common import check_positive, draft_depths, say


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conformance",
        help="write conformance vectors: every greedy decode decision on a bundle, for the "
        "app-side decode core (apps/core) to replay without the model",
    )
    p.add_argument("--bundle", type=Path, required=True, help="an export bundle")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for vectors.json (replaced when it holds nothing else)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=4,
        help="prompts; the first 4 exercise one prefill chunk, several chunks, the sliding "
        "ring wrapping and the context end, more get seeded random lengths",
    )
    p.add_argument("--tokens", type=int, default=48, help="committed tokens per generation")
    p.add_argument(
        "--depths",
        type=draft_depths,
        help="pinned draft depths (default: 0 to the bundle's deepest)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.runtime.conformance import (
        check_out,
        record_vectors,
        replay_vectors,
        write_vectors,
    )

    check_positive("--prompts", args.prompts)
    check_positive("--tokens", args.tokens, 2)
    check_out(args.out)  # before minutes of decoding, not after
    torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    vectors = record_vectors(
        args.bundle, prompts=args.prompts, tokens=args.tokens, depths=args.depths, progress=say
    )
    checked = replay_vectors(vectors)  # the engine agrees with what it is about to publish
    path = write_vectors(vectors, args.out)
    rounds = [r for c in vectors["cases"] for r in c["rounds"]]
    print(
        f"wrote {path}: {checked['cases']} cases, {checked['rounds']} decode rounds "
        f"({sum(r['accepted'] for r in rounds)} of {sum(r['depth'] for r in rounds)} drafts "
        f"accepted), {checked['method_choices']} method choices; replayed by the Python runtime"
    )
    return 0

"""`edgemtp bench` and `edgemtp bench collect`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgemtp.cli.common import bundle_threads, check_positive, draft_depths, say


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure a bundle: prefill and decode tok/s by draft depth, llama-bench style "
        "(`edgemtp bench collect` merges results from devices)",
    )
    p.add_argument("--bundle", type=Path, required=True, help="an export bundle")
    p.add_argument("--delegate", choices=("cpu", "metal", "npu", "htp"), help="as for generate")
    p.add_argument("--pp", type=_counts, default=(128, 512, 2048), help="prompt lengths: ppN tests")
    p.add_argument("--tg", type=_counts, default=(128,), help="generated lengths: tgN tests")
    p.add_argument(
        "--mtp",
        type=_bench_depths,
        help="draft depths, 0 = AR, auto = the adaptive depth (default: every depth the bundle "
        "has)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per test (median)")
    p.add_argument("--tg-prompt", type=int, default=32, help="prompt tokens before a tg test")
    p.add_argument(
        "--prompts",
        type=Path,
        help="prompt texts: a JSON list, or text with blank lines between prompts (default: the "
        "embedded model's held-out prompts)",
    )
    p.add_argument(
        "--acceptance-oracle",
        type=float,
        metavar="RATE",
        help="MTP rounds draft the AR run's own tokens, each kept with probability RATE (the "
        "drafter still runs): mechanics at a controlled acceptance, labelled as such",
    )
    p.add_argument(
        "--device",
        help="device profile for the simulator's prediction beside each row (default: host, "
        "once `edgemtp devices calibrate` wrote it; none: no prediction)",
    )
    p.add_argument("--threads", type=int, help="compute threads (default: as generate)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and oracle draws")
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of files")
    p.add_argument("--out", type=Path, default=Path("bench"), help="report folder (bench/)")

    c = sub.add_parser(
        "bench-collect",
        prog="edgemtp bench collect",
        help="`edgemtp bench collect`: merge bench results from a device or folder into a report",
    )
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--from", dest="folder", type=Path, help="a folder of result files")
    where.add_argument("--adb", action="store_true", help="pull the Android app's results")
    c.add_argument("--serial", help="with --adb: the device (`adb devices`)")
    c.add_argument("--out", type=Path, default=Path("bench"), help="report folder to merge into")


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give token counts like 128,512") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': token counts are >= 1")
    return values


def _bench_depths(text: str) -> tuple[int | str, ...]:
    """Pinned depths, and `auto` (the adaptive depth) if named: 0,1,2,3,auto."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    pinned = [x for x in items if x != "auto"]
    auto: tuple[str, ...] = ("auto",) if "auto" in items else ()
    return (*(draft_depths(",".join(pinned)) if pinned else ()), *auto)


def run(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from edgemtp.devices.profiles import USER_PROFILE_DIR
    from edgemtp.model.embedded import PROMPTS
    from edgemtp.runtime import bench
    from edgemtp.runtime.bench_report import text_table, write_report
    from edgemtp.runtime.session import Session

    check_positive("--threads", args.threads)
    texts = bench.read_prompt_texts(args.prompts) if args.prompts else []
    if not args.prompts and PROMPTS.is_file():
        texts = json.loads(PROMPTS.read_text())
    threads = args.threads or bundle_threads(args.bundle)
    session = Session.from_bundle(
        args.bundle,
        delegate=args.delegate,
        threads=threads,
        verify=not args.no_verify,
        progress=say,
    )
    torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    backend = session.backend
    depths = args.mtp or tuple(range(backend.max_draft + 1 if backend.has_drafter else 1))
    plan = bench.BenchPlan(
        args.pp, args.tg, depths, args.repeat, args.tg_prompt, args.acceptance_oracle, args.seed
    )
    device = args.device
    if device is None and (USER_PROFILE_DIR / "host.toml").is_file():
        device = "host"
    runs = bench.run_bench(session, plan, texts, say)
    predictions = None
    if device not in (None, "none"):
        from edgemtp.devices.bench_prediction import predict_bench

        predictions = predict_bench(args.bundle, device, session.info["delegate"], plan, runs)
    elif device is None:
        say("no host profile: `edgemtp devices calibrate` once to see predictions beside these")
    command = "edgemtp " + shlex.join(["bench", *sys.argv[2:]])
    doc = bench.result_document(
        command,
        bench.machine_info(threads),
        bench.bundle_info(args.bundle, session.info),
        plan,
        runs,
        predictions,
    )
    out = write_report([doc], args.out)
    print(text_table([doc]))
    print(f"wrote {out}/bench.md, its plots and {out}/results/")
    return 0


def run_collect(args: argparse.Namespace) -> int:
    from edgemtp.runtime.bench_report import collect, read_result, text_table

    files = collect(args.out, args.folder, args.adb, args.serial)
    print(text_table([read_result(f) for f in files]))
    print(f"wrote {args.out}/bench.md from {len(files)} result files")
    return 0

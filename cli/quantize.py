"""`edgemtp quantize` and `edgemtp quantize-report`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edgemtp.errors import EdgeMTPError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="quantize a float target or drafter checkpoint to Q4_0 or W4A16"
    )
    p.add_argument("--model", required=True, type=Path, help="float checkpoint folder (HF layout)")
    p.add_argument("--scheme", required=True, choices=["q4_0", "w4a16"])
    p.add_argument("--group", type=int, help="w4a16 group size (default 128; q4_0 is 32)")
    p.add_argument("--asymmetric", action="store_true", help="w4a16 with zero points")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"], help="w4a16 rounding")
    p.add_argument("--calib", type=Path, help="calibration text for --method gptq")
    p.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens to use")
    p.add_argument(
        "--embeddings",
        default="q4_0",
        choices=["q4_0", "int8", "fp16"],
        help="token table (and tied LM head); default q4_0",
    )
    p.add_argument(
        "--ple",
        default="int8",
        choices=["q4_0", "int8", "fp16"],
        help="per-layer embedding table; default int8",
    )
    p.add_argument("--scale-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
    p.add_argument("--report", type=Path, metavar="TEXT", help="then run quantize-report on TEXT")
    p.add_argument("--drafter", type=Path, help="float drafter, for the report's MTP acceptance")

    r = sub.add_parser("quantize-report", help="what quantization cost, on a text file")
    r.add_argument("--model", required=True, type=Path, help="float target checkpoint")
    r.add_argument("--quantized", required=True, type=Path, help="quantized target (any format)")
    r.add_argument(
        "--text",
        type=Path,
        required=True,
        help="text (with the model's tokenizer.json) or, for models without one, token ids",
    )
    r.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score")
    r.add_argument("--drafter", type=Path, help="float drafter (MTP acceptance before)")
    r.add_argument("--quantized-drafter", type=Path, help="quantized drafter (after)")
    r.add_argument("--out", type=Path, help="write OUT.json, OUT.txt and OUT.png")


def run(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
    from edgemtp.runtime.probes import peak_rss_mb

    settings = Settings(
        scheme=args.scheme,
        group_size=args.group or (32 if args.scheme == "q4_0" else 128),
        symmetric=not args.asymmetric,
        method=args.method,
        embeddings=args.embeddings,
        ple=args.ple,
        scale_dtype=torch.bfloat16 if args.scale_dtype == "bfloat16" else torch.float16,
    )
    settings.validate()
    hessians = None
    if args.method == "gptq":
        hessians = _calibration_hessians(args)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    summary = quantize_checkpoint(
        args.model, args.out, settings, hessians, progress=progress, overwrite=args.force
    )
    peak_mb = peak_rss_mb()
    print(
        f"wrote {args.out}: {summary['bytes'] / 2**30:.3f} GiB in {summary['seconds']:.1f} s, "
        f"peak RSS {peak_mb:.0f} MB"
    )
    if summary["kept_fp16"]:
        print(
            f"kept in fp16 (input width not a multiple of the group): {len(summary['kept_fp16'])} "
            f"tensors, e.g. {summary['kept_fp16'][0]}"
        )
    if args.report:
        report_args = argparse.Namespace(
            model=args.model,
            quantized=args.out,
            text=args.report,
            tokens=2048,
            drafter=args.drafter,
            quantized_drafter=None,
            out=args.out / "quantization_report",
        )
        return run_report(report_args)
    return 0


def run_report(args: argparse.Namespace) -> int:
    import json

    import torch

    from edgemtp.quantize.load import load_drafter, load_target
    from edgemtp.runtime.quality import build_report, plot_weight_error
    from edgemtp.runtime.tokenizer import token_file

    ids = token_file(args.text, args.model, args.tokens + 1)
    reference, quantized = load_target(args.model), load_target(args.quantized)
    if reference.cfg.layers != quantized.cfg.layers:
        raise EdgeMTPError(f"{args.quantized} is not a quantization of {args.model}")
    drafters = None
    if args.drafter:
        float_drafter = load_drafter(args.drafter, reference.cfg)
        q_drafter = (
            load_drafter(args.quantized_drafter, quantized.cfg)
            if args.quantized_drafter
            else float_drafter
        )
        drafters = (float_drafter, q_drafter)

    def progress(msg: str) -> None:
        print(f"report: {msg}", file=sys.stderr, flush=True)

    with torch.no_grad():
        report = build_report(reference, quantized, ids, drafters, progress)
    print(report.table())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report.as_dict(), indent=1))
        args.out.with_suffix(".txt").write_text(report.table() + "\n")
        plot_weight_error(report, args.out.with_suffix(".png"), args.quantized.name)
        print(f"wrote {args.out}.json, .txt and .png")
    return 0


def _calibration_hessians(args: argparse.Namespace) -> dict:
    from edgemtp.quantize.gptq import collect_hessians
    from edgemtp.quantize.load import load_target
    from edgemtp.runtime.tokenizer import token_file

    if args.calib is None:
        raise EdgeMTPError("--method gptq needs --calib FILE (a few thousand tokens of text)")
    ids = token_file(args.calib, args.model, args.calib_tokens)
    target = load_target(args.model)
    chunk = 512
    return collect_hessians(target, [ids[i : i + chunk] for i in range(0, len(ids), chunk)])

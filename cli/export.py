"""`edgemtp export`: a target (+ MTP drafter) lowered to an ExecuTorch, Core ML or ONNX bundle."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgemtp.cli.common import check_positive
from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import KV_CACHE_KINDS

if TYPE_CHECKING:
    from edgemtp.model.config import TextConfig
    from edgemtp.model.static import StaticShapes

# --attention (the old name of --kernels) -> --kernels
ATTENTION = {"kernel": "edgemtp", "matmul": "xnnpack"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="lower a target (+ MTP drafter) to an ExecuTorch, Core ML or ONNX bundle"
    )
    p.add_argument(
        "--model", required=True, type=Path, help="target: HF folder, quantized folder or .gguf"
    )
    p.add_argument("--drafter", type=Path, help="MTP assistant (without: AR-only bundle)")
    p.add_argument(
        "--quant",
        default="auto",
        choices=["auto", "none", "q4_0", "w4a16"],
        help="4-bit scheme (float checkpoints are quantized first, group 32); auto = as stored",
    )
    p.add_argument("--backend", required=True, choices=["executorch", "coreml", "onnx"])
    p.add_argument("--delegate", default="cpu", choices=["cpu", "metal", "npu", "htp"])
    p.add_argument("--max-context", type=int, default=4096, help="tokens the cache holds")
    p.add_argument(
        "--draft-depth",
        type=int,
        help="most drafts verified at once (default 3 with --drafter; 0 without: an AR-only "
        "bundle has no verify rounds to build)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, help="rows per prefill call (default 128, at most the ring)"
    )
    p.add_argument(
        "--context-buckets",
        default="auto",
        help="cache lengths with their own prefill and decode methods that read only that "
        "many slots "
        "(ExecuTorch cpu): comma-separated, 'none', or 'auto' = 512, 2048, ... below "
        "--max-context",
    )
    p.add_argument(
        "--verify-depths",
        default="ends",
        help="draft depths with their own verify method: 'ends' (default: 0 and --draft-depth; "
        "a shallower round is padded into the deepest), 'all' (every depth: no round pays for "
        "rows it did not draft, for a method more per depth) or comma-separated depths",
    )
    p.add_argument(
        "--draft-chains",
        action="store_true",
        help="ExecuTorch cpu with a drafter: greedy draft chains draft_K, K drafter steps with "
        "their picks and token lookups in one program call",
    )
    p.add_argument(
        "--activations",
        choices=("int8", "fp32"),
        help="ONNX cpu: what the 4-bit linears multiply; int8 (default, as XNNPACK's 8da4w: "
        "faster decode) or fp32 (the reference engine's numerics)",
    )
    p.add_argument(
        "--kernels",
        choices=("edgemtp", "xnnpack"),
        help="which kernels an ExecuTorch cpu bundle runs its decode, verify and draft steps "
        "in: edgemtp's own (default: Q4_0 linears, attention, norms, a float16 KV cache) or "
        "XNNPACK's only, what the stock ExecuTorch runtimes have",
    )
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_KINDS,
        help="the KV cache's dtype: int8 (each token's K and V rows per KV head as symmetric "
        "codes and a float32 scale: about half float16's bytes, read in place by edgemtp's "
        "attention kernel; ExecuTorch cpu with --kernels edgemtp) or fp16 / fp32; default: "
        "the bundle form's (fp16 with edgemtp's kernels, else fp32)",
    )
    # --kernels' old name (the switch covers more than attention): hidden, warns when used
    p.add_argument("--attention", choices=tuple(ATTENTION), help=argparse.SUPPRESS)
    p.add_argument(
        "--max-memory",
        type=float,
        metavar="GIB",
        help="refuse before starting when the export's estimated peak is over this many GiB, "
        "and stop it (nothing written) if it holds more while it runs",
    )
    p.add_argument("--out", required=True, type=Path, help="bundle folder to create")
    p.add_argument("--force", action="store_true", help="replace an existing bundle at --out")


def context_buckets(text: str, args: argparse.Namespace) -> tuple[int, ...]:
    from edgemtp.model.static import auto_context_buckets

    if text == "none":
        return ()
    if text == "auto":
        cpu = (args.backend, args.delegate) == ("executorch", "cpu")
        return auto_context_buckets(args.max_context) if cpu else ()
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise EdgeMTPError(
            f"--context-buckets {text!r}: give token counts like 512,2048, 'auto' or 'none'"
        ) from None


def with_verify_depths(shapes: StaticShapes, text: str) -> StaticShapes:
    """The shapes with --verify-depths' verify methods."""
    if text == "ends":
        return shapes
    if text == "all":
        return shapes.every_depth()
    try:
        depths = tuple(int(d) for d in text.split(","))
        return replace(shapes, verify_depths=depths)
    except ValueError as e:
        reason = str(e) if "must include" in str(e) else "give depths like 0,1,3"
        raise EdgeMTPError(f"--verify-depths {text!r}: {reason}; or pass 'ends' or 'all'") from None


def check_draft_chains(args: argparse.Namespace) -> None:
    """Draft chains run the drafter's picks in the program: ExecuTorch's cpu delegate only."""
    if args.drafter is None:
        raise EdgeMTPError("--draft-chains: a bundle without --drafter has nothing to draft")
    if (args.backend, args.delegate) != ("executorch", "cpu"):
        raise EdgeMTPError(
            f"--draft-chains: only ExecuTorch cpu bundles have draft chains (this is "
            f"{args.backend}/{args.delegate}); drop it, the runtime drafts step by step"
        )
    if args.draft_depth < 1:
        raise EdgeMTPError("--draft-chains: --draft-depth 0 drafts nothing; give 1 or more")


def _check_context(max_context: int, max_draft: int, cfg: TextConfig, model: Path) -> None:
    """A context the model was not trained for, or a cache larger than this machine's memory,
    is refused before anything is allocated."""
    from edgemtp.model.cache import cache_bytes
    from edgemtp.runtime.probes import physical_memory

    if max_context > cfg.max_position_embeddings:
        raise EdgeMTPError(
            f"--max-context {max_context}: {model} attends to at most "
            f"{cfg.max_position_embeddings} positions (max_position_embeddings); use no more"
        )
    need, have = cache_bytes(cfg, max_context, max_draft), physical_memory()  # (as float32)
    if need > have:
        raise EdgeMTPError(
            f"--max-context {max_context}: the KV cache alone takes {need / 2**30:.2f} GiB, more "
            f"than this machine's {have / 2**30:.2f} GiB of memory; use a smaller --max-context"
        )


def _kernels(args: argparse.Namespace) -> str | None:
    """--kernels, or its deprecated alias --attention; None leaves export/ its default
    (edgemtp's kernels on ExecuTorch cpu)."""
    if args.attention is not None:
        if args.kernels is not None:
            raise EdgeMTPError("--attention is the old name of --kernels: pass only --kernels")
        print(
            "edgemtp export: --attention is deprecated; use --kernels edgemtp|xnnpack",
            file=sys.stderr,
        )
        return ATTENTION[args.attention]
    return args.kernels


def run(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.export.bundle import ExportRequest, export
    from edgemtp.model.cache import cache_slots
    from edgemtp.model.checkpoint import target_config
    from edgemtp.model.static import StaticShapes
    from edgemtp.quantize.load import open_checkpoint
    from edgemtp.runtime.probes import current_rss_mb, peak_rss_mb

    kernels = _kernels(args)
    check_positive("--max-context", args.max_context, 2)
    if args.max_memory is not None and not args.max_memory > 0:
        raise EdgeMTPError(f"--max-memory must be a positive number of GiB, got {args.max_memory}")
    if args.draft_depth is None:
        args.draft_depth = 3 if args.drafter else 0
    check_positive("--draft-depth", args.draft_depth, 0)
    check_positive("--prefill-chunk", args.prefill_chunk)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    if not args.model.exists():
        raise EdgeMTPError(f"{args.model} does not exist")
    source = open_checkpoint(args.model)
    cfg = target_config(source.config, str(source.path))
    _check_context(args.max_context, args.draft_depth, cfg, args.model)
    smallest = min(cache_slots(cfg, args.max_context, args.draft_depth).values())
    chunk = args.prefill_chunk or min(128, smallest)
    if chunk > smallest:
        raise EdgeMTPError(
            f"--prefill-chunk {chunk} exceeds the smallest cache ({smallest} slots: sliding "
            f"window {cfg.sliding_window} + draft depth {args.draft_depth} + 1); use <= {smallest}"
        )
    buckets = context_buckets(args.context_buckets, args)
    try:
        shapes = StaticShapes(args.max_context, args.draft_depth, chunk, buckets)
    except ValueError as e:
        raise EdgeMTPError(f"--context-buckets: {e}") from None
    shapes = with_verify_depths(shapes, args.verify_depths)
    if args.draft_chains:
        check_draft_chains(args)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:  # with the memory held now and the peak so far
        now, peak = current_rss_mb(), peak_rss_mb()
        held = f" [rss {now / 1024:.2f}, peak {peak / 1024:.2f} GiB]" if now and peak else ""
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}{held}", file=sys.stderr, flush=True)

    request = ExportRequest(
        args.model,
        args.drafter,
        args.quant,
        args.backend,
        args.delegate,
        shapes,
        args.out,
        args.force,
        args.activations,
        kernels,
        args.draft_chains,
        None if args.max_memory is None else round(args.max_memory * 2**30),
        args.kv_cache,
    )
    manifest = export(request, progress)
    size = sum(f["bytes"] for f in manifest["files"].values())
    peak_mb = peak_rss_mb()
    print(
        f"wrote {args.out}: {size / 2**20:.1f} MiB ({manifest['quantization']['scheme']}, "
        f"{args.backend}/{args.delegate}, {len(manifest['methods'])} methods) in "
        f"{time.perf_counter() - t0:.1f} s, peak RSS {peak_mb:.0f} MB"
    )
    return 0

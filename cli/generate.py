"""`edgemtp generate`: text from an export bundle or, on the reference engine, from checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from edgemtp.cli.common import bundle_threads, check_positive, default_threads
from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import KV_CACHE_KINDS


def _ids(text: str) -> list[int]:
    """Token ids separated by commas or spaces (argparse reports what it raises)."""
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text[:80]}' is not token ids (integers separated by commas or spaces)"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _mtp(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected auto or a depth (0 = AR)") from None
    if depth < 0:
        raise argparse.ArgumentTypeError(f"--mtp must be auto or >= 0, got {depth}")
    return depth


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from an export bundle or a checkpoint (reference CPU)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="export bundle folder (edgemtp export)")
    src.add_argument("--model", type=Path, help="target checkpoint folder: the reference engine")
    p.add_argument("--drafter", type=Path, help="MTP assistant checkpoint folder (with --model)")
    p.add_argument(
        "--delegate",
        choices=["cpu", "metal", "npu", "htp"],
        help="run a bundle on another delegate than it was exported for, where its backend can "
        "(ONNX htp bundle on the CPU EP; Core ML compute units)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the tokenizer.json of the model)")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 2,651,1234")
    p.add_argument("--max-new-tokens", type=int, required=True, help="committed tokens to make")
    p.add_argument(
        "--mtp",
        type=_mtp,
        default="auto",
        help="draft depth: auto (default; the fastest depth as measured while running, 0 "
        "without a drafter) or a pinned depth (0 = plain AR)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token(s)")
    p.add_argument("--no-prune", action="store_true", help="no prefill pruning (A/B; --model)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="rows per prefill (--model)")
    p.add_argument("--max-context", type=int, help="reference cache size (--model; default 4096)")
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_KINDS,
        help="the reference cache's dtype (--model; default fp32); int8: one scale per token "
        "and KV head, for K and V",
    )
    p.add_argument(
        "--numerics",
        choices=("reference", "executorch"),
        default="reference",
        help="what --model computes: reference (default: float32 activations), or executorch: "
        "what an ExecuTorch cpu bundle of these 4-bit checkpoints computes (edgemtp's kernels, "
        "its cache dtype: fp16, or --kv-cache), token for token the bundle's",
    )
    p.add_argument(
        "--max-draft", type=int, default=4, help="deepest draft for --mtp auto (--model)"
    )
    p.add_argument("--chat", action="store_true", help="apply Gemma's chat turn format")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 check of the bundle's files (for repeated loads of one bundle)",
    )
    p.add_argument("--battery-wh", type=float, help="battery capacity, for battery %% per 1k")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument(
        "--threads",
        type=int,
        help="compute threads (torch, XNNPACK or ORT; default: 1 for small models, where "
        "waking a thread pool costs more than it saves and collapses on a busy machine; all "
        "cores otherwise)",
    )


def _open_session(args: argparse.Namespace):
    """The session `generate` runs: a bundle, or the reference engine over checkpoints."""
    from edgemtp.runtime.session import Session

    def progress(msg: str) -> None:
        if not args.json:
            print(f"-- {msg}", file=sys.stderr, flush=True)

    if args.bundle is not None:
        given_flags = (
            ("--drafter", args.drafter),
            ("--max-context", args.max_context),
            ("--kv-cache", args.kv_cache),
            ("--numerics", args.numerics != "reference"),
        )
        for flag, given in given_flags:
            if given:
                raise EdgeMTPError(f"{flag} is for --model; a bundle carries its own")
        if args.no_prune:
            raise EdgeMTPError("--no-prune is for --model; a bundle's prefill always prunes")
        if args.no_verify:
            progress("--no-verify: not checking the bundle's files against their SHA-256")
        return Session.from_bundle(
            args.bundle,
            delegate=args.delegate,
            threads=args.threads or bundle_threads(args.bundle),
            verify=not args.no_verify,
            progress=progress,
        )
    if args.delegate not in (None, "cpu"):
        raise EdgeMTPError("--model runs the reference engine on the CPU; export a bundle first")
    if args.mtp not in ("auto", 0) and not args.drafter:
        raise EdgeMTPError("--mtp needs --drafter (an MTP assistant checkpoint)")
    options = {
        "max_context": args.max_context,
        "max_draft": max(args.max_draft, args.mtp if isinstance(args.mtp, int) else 0),
        "prefill_chunk": args.prefill_chunk,
        "prune": not args.no_prune,
        "kv_cache": args.kv_cache,
    }
    if args.numerics == "reference":
        return Session.from_checkpoints(args.model, args.drafter, **options)
    return _in_bundle_numerics(args, options)


def _in_bundle_numerics(args: argparse.Namespace, options: dict):
    """The reference engine computing what an ExecuTorch cpu bundle exported from these
    checkpoints computes: the Q4_0 blocks through edgemtp's kernels' arithmetic, the cache in
    the bundle's dtype. An export of the same checkpoints decodes the same tokens."""
    from edgemtp.export.forms import form_for
    from edgemtp.export.weights import attach_int4
    from edgemtp.model.cache import KV_CACHE_DTYPES
    from edgemtp.quantize.load import load_drafter, load_target
    from edgemtp.runtime.session import Session

    form = form_for("executorch", "cpu", "edgemtp", args.kv_cache)
    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target.cfg) if args.drafter else None
    for model, folder in ((target, args.model), (drafter, args.drafter)):
        if model is None:
            continue
        if not attach_int4(model.model, model.source, model.names):
            raise EdgeMTPError(
                f"--numerics executorch computes with the 4-bit blocks an export runs, and "
                f"{folder} holds float weights: quantize it first (edgemtp quantize --model "
                f"{folder} --scheme q4_0 --out DIR) and pass DIR"
            )
        model.use_form(form)
    kind = {dtype: kind for kind, dtype in KV_CACHE_DTYPES.items()}[form.cache_dtype]
    return Session.from_models(target, drafter, args.model, **{**options, "kv_cache": kind})


def run(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.runtime.probes import EnergyMeter, peak_rss_mb
    from edgemtp.runtime.sampling import SamplingParams

    check_positive("--max-new-tokens", args.max_new_tokens)
    check_positive("--prefill-chunk", args.prefill_chunk)
    check_positive("--threads", args.threads)
    check_positive("--max-context", args.max_context, 2)
    check_positive("--max-draft", args.max_draft, 0)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    session = _open_session(args)
    load_s = time.perf_counter() - t0
    if args.bundle is None:
        torch.set_num_threads(args.threads or default_threads(session.backend.target.cfg))
    else:
        torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    tokenizer = session.tokenizer
    if args.prompt is not None:
        if tokenizer is None:
            where = args.bundle or args.model
            raise EdgeMTPError(f"{where}: no tokenizer.json; pass --prompt-ids instead")
        prompt = tokenizer.encode_prompt(args.prompt, chat=args.chat)
    else:
        if args.chat:
            raise EdgeMTPError("--chat needs --prompt text")
        prompt = args.prompt_ids
    stop_ids = () if args.ignore_eos else session.stop_ids

    out_ids: list[int] = []
    printed = [0]  # characters of the decoded text already written

    def stream(new: list[int]) -> None:
        if args.json:
            return
        out_ids.extend(new)
        if tokenizer:
            text = tokenizer.decode(out_ids)
            sys.stdout.write(text[printed[0] :])
            printed[0] = len(text)
        else:
            sys.stdout.write("".join(f"{t} " for t in new))
        sys.stdout.flush()

    energy = EnergyMeter(battery_wh=args.battery_wh)
    energy.begin()
    with torch.no_grad():
        result = session.generate(
            prompt,
            args.max_new_tokens,
            mtp=args.mtp,
            params=params,
            stop_ids=tuple(stop_ids),
            on_tokens=stream,
        )
    metrics = {
        **result.metrics(),
        "load_s": load_s,
        "stop_reason": result.stop_reason,
        "peak_rss_mb": peak_rss_mb(),
        "energy": energy.report(len(result.tokens)),
        "mtp": args.mtp,
    }
    if args.mtp == "auto" and session.adaptive is not None:
        metrics["adaptive"] = session.adaptive.summary()
    if args.json:
        payload = {
            "tokens": result.tokens,
            "text": tokenizer.decode(result.tokens) if tokenizer else None,
            "prompt_ids": prompt,
            "session": session.info,
            "metrics": metrics,
            "trace": [asdict(step) for step in result.steps],
        }
        print(json.dumps(payload))
    else:
        print()
        rate = metrics["decode_tok_s"]
        summary = [
            f"{metrics['generated_tokens']} tokens",
            f"ttft {metrics['ttft_s'] * 1000:.1f} ms",
            f"prefill {metrics['prefill_tok_s']:.1f} tok/s" if metrics["prefill_tok_s"] else "",
            f"decode {rate:.1f} tok/s" if rate else "",
        ]
        if metrics["drafted"]:
            depths = ", ".join(f"{k}x{n}" for k, n in metrics["mtp_depths_used"].items())
            summary.append(
                f"accepted {metrics['accepted']}/{metrics['drafted']} drafts, "
                f"{metrics['mean_committed_per_forward']:.2f} tokens/forward (depth x rounds: "
                f"{depths})"
            )
        if metrics["peak_rss_mb"] is not None:
            summary.append(f"peak RSS {metrics['peak_rss_mb']:.0f} MB")
        print("-- " + ", ".join(s for s in summary if s), file=sys.stderr)
    if result.stop_reason == "interrupted":
        print(f"edgemtp generate: interrupted after {len(result.tokens)} tokens", file=sys.stderr)
        return 130
    return 0

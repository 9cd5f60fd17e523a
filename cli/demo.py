"""`edgemtp demo`: the embedded default pair, exported and run with MTP and with AR.

With no arguments: export `checkpoints/embedded-target` + `checkpoints/embedded-assistant`
(shipped in the package) to a Q4_0 ExecuTorch bundle for the cpu delegate, cached under
`~/.cache/edgemtp/` by a hash of the weights and the edgemtp version (the first run lowers it;
later runs reuse it), then generate from held-out prompts with AR and with MTP on identical
inputs, interleaved, and report the median decode speed of each, the speed-up and the mean
committed tokens per target forward (warm-up excluded; decode speed (n_out - 1) / (t_end -
t_first); greedy MTP tokens checked equal to AR's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemtp import __version__
from edgemtp.cli.common import check_positive, say
from edgemtp.errors import EdgeMTPError
from edgemtp.model.embedded import ASSISTANT, PROMPTS, TARGET


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
    check_positive("--tokens", args.tokens, 2)
    check_positive("--repeat", args.repeat)
    check_positive("--depth", args.depth)
    settings = DemoSettings(depth=args.depth, tokens=args.tokens, repeat=args.repeat)
    # progress goes to stderr also with --json
    result = run_demo(args.target or TARGET, args.drafter or ASSISTANT, args.out, settings, say)
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


CACHE = Path.home() / ".cache" / "edgemtp"


@dataclass(frozen=True)
class DemoSettings:
    depth: int = 3  # MTP depth the demo pins (the bundle verifies up to this many drafts)
    tokens: int = 128
    repeat: int = 5
    max_context: int = 512
    chunk: int = 64
    threads: int = 1


def bundle_key(target: Path, drafter: Path, settings: DemoSettings, kernels: str) -> str:
    """Same weights, shapes, kernels and edgemtp version -> same cached bundle."""
    shape = f"{__version__} {settings.max_context} {settings.depth} {settings.chunk} {kernels}"
    h = hashlib.sha256(shape.encode())
    for folder in (target, drafter):
        for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def ensure_bundle(
    target: Path,
    drafter: Path,
    out: Path | None,
    settings: DemoSettings,
    say: Callable[[str], None],
) -> Path:
    """The cached Q4_0 ExecuTorch bundle of the pair, exported first when missing."""
    from edgemtp.export.bundle import ExportRequest, export
    from edgemtp.model.static import StaticShapes
    from edgemtp.runtime.bundle import MANIFEST

    for folder in (target, drafter):
        if not (folder / "config.json").is_file():
            raise EdgeMTPError(f"{folder}: no config.json (the embedded models are missing?)")
    # edgemtp's kernels where this machine can build them: its steps, verify rounds and draft
    # steps all run faster there than in XNNPACK alone (benchmarks/README.md, "MTP rounds").
    from edgemtp.runtime import kernels as edgemtp_kernels

    kernels = "xnnpack" if edgemtp_kernels.unavailable() else "edgemtp"
    out = out or CACHE / f"demo-{bundle_key(target, drafter, settings, kernels)}" / "bundle"
    if (out / MANIFEST).is_file():
        say(f"bundle: {out} (cached)")
        return out
    say(
        f"exporting the embedded pair to {out} (Q4_0, ExecuTorch, {kernels} kernels; once, "
        "a few minutes)"
    )
    # a verify per depth and greedy draft chains: one drafter call and one target call a round
    shapes = StaticShapes(settings.max_context, settings.depth, settings.chunk).every_depth()
    request = ExportRequest(
        target,
        drafter,
        "q4_0",
        "executorch",
        "cpu",
        shapes,
        out,
        kernels=kernels,
        draft_chains=True,
    )
    export(request, say)
    return out


def load_prompts(session: Any) -> list[list[int]]:
    if session.tokenizer is None:
        raise EdgeMTPError("the demo bundle has no tokenizer.json")
    texts = json.loads(PROMPTS.read_text()) if PROMPTS.is_file() else ["def "]
    return [session.tokenizer.encode_prompt(t) for t in texts]


def run_demo(
    target: Path = TARGET,
    drafter: Path = ASSISTANT,
    out: Path | None = None,
    settings: DemoSettings | None = None,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    mtp_depth: int | None = None,
) -> dict[str, Any]:
    """AR vs MTP on the pair's demo bundle; `mtp_depth` (default: the bundle's `settings.depth`)
    may be shallower than the bundle's, whose deepest verify method then takes padded rounds."""
    import torch

    from edgemtp.runtime.session import Session

    settings = settings or DemoSettings()
    depth = settings.depth if mtp_depth is None else mtp_depth
    if not 1 <= depth <= settings.depth:
        raise EdgeMTPError(f"MTP depth {depth} is outside the bundle's 1..{settings.depth}")
    torch.set_num_threads(1)
    bundle = ensure_bundle(target, drafter, out, settings, say)
    session = Session.from_bundle(bundle, threads=settings.threads, verify=False)
    prompts = load_prompts(session)
    first = prompts[0]
    session.generate(first, 16, mtp=0, stop_ids=())  # warm-up: first calls, page faults
    session.generate(first, 16, mtp=depth, stop_ids=())
    runs: dict[str, list[dict[str, Any]]] = {"ar": [], "mtp": []}
    for repeat in range(settings.repeat):
        say(f"run {repeat + 1}/{settings.repeat}: AR and MTP depth {depth}")
        for prompt in prompts:
            for mode, mtp in (("ar", 0), ("mtp", depth)):
                session.reset()
                # no stop tokens: every run decodes the same number of tokens
                result = session.generate(prompt, settings.tokens, mtp=mtp, stop_ids=())
                runs[mode].append({"prompt": prompt, "result": result, **result.metrics()})
    ar_tok_s = statistics.median(r["decode_tok_s"] for r in runs["ar"] if r["decode_tok_s"])
    mtp_tok_s = statistics.median(r["decode_tok_s"] for r in runs["mtp"] if r["decode_tok_s"])
    # Greedy MTP is lossless up to near-ties: XNNPACK's int8-activation kernels round a
    # multi-row verify differently from a one-row step, which can flip a top-2 tie.
    equal_runs = sum(
        a["result"].tokens == m["result"].tokens
        for a, m in zip(runs["ar"], runs["mtp"], strict=True)
    )
    committed = statistics.mean(r["mean_committed_per_forward"] for r in runs["mtp"])
    by_phase = {mode: _ms_per_token_by_phase(rows) for mode, rows in runs.items()}
    shown = runs["mtp"][0]["result"]
    assert session.tokenizer is not None
    return {
        "ar_decode_tok_s": ar_tok_s,
        "mtp_decode_tok_s": mtp_tok_s,
        "speedup": mtp_tok_s / ar_tok_s,
        "mean_committed_per_forward": committed,
        "depth": depth,
        "bundle": str(bundle),
        "text": session.tokenizer.decode(shown.tokens),
        "prompt": session.tokenizer.decode(prompts[0]),
        "mtp_tokens_equal_ar": equal_runs == len(runs["mtp"]),
        "mtp_runs_equal_ar": equal_runs,
        "decode_ms_per_token_by_phase": by_phase,
        "runs": settings.repeat,
        "prompts": len(prompts),
        "tokens_per_run": settings.tokens,
    }


def _ms_per_token_by_phase(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Decode time per committed token, split by phase (target and drafter program calls,
    embedding lookups, sampling, the rest of the host loop), over all runs of one mode."""
    tokens = sum(len(r["result"].tokens) - 1 for r in runs)
    phases: dict[str, float] = {}
    for r in runs:
        for phase, seconds in r["decode_seconds_by_phase"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return {phase: round(1000 * s / tokens, 4) for phase, s in phases.items()}

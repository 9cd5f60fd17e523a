"""ONNX cpu bundles with int8 activations (the default) against fp32 ones, side by side.

    OMP_NUM_THREADS=1 python benchmarks/onnx_activations.py [--repeat 5] [--tokens 128]

Exports the embedded pair (Q4_0, ONNX cpu, max context 512, depth 3, chunk 64) twice,
`--activations int8` and `--activations fp32`, into --work; then, in one process, decodes the
demo's held-out prompts with each bundle at depths 0-3, interleaved (every prompt, depth and
bundle once per round), greedy, 1 thread, no stop tokens. Reports the median decode tok/s
((n_out - 1) / (t_end - t_first)), the int8/fp32 ratio per depth, the ratio of each to its own
AR, and how many runs gave the same tokens on both bundles. Writes
OUT/onnx_activations.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, command_line, machine, pyplot, save_figure, write_results

from edgemtp.cli import main as edgemtp
from edgemtp.cli.demo import load_prompts
from edgemtp.model.embedded import ASSISTANT, TARGET
from edgemtp.runtime.session import Session

KINDS = ("int8", "fp32")
DEPTHS = (0, 1, 2, 3)


def export(work: Path) -> dict[str, Path]:
    bundles = {}
    for kind in KINDS:
        out = work / f"demo-onnx-{kind}"
        if not (out / "manifest.json").is_file():
            code = edgemtp([
                "export", "--model", str(TARGET), "--drafter", str(ASSISTANT), "--quant", "q4_0",
                "--backend", "onnx", "--max-context", "512", "--draft-depth", "3",
                "--prefill-chunk", "64", "--activations", kind, "--out", str(out),
            ])  # fmt: skip
            if code:
                raise SystemExit(f"export --activations {kind} failed")
        bundles[kind] = out
    return bundles


def measure(bundles: dict[str, Path], repeat: int, tokens: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    sessions = {k: Session.from_bundle(p, threads=1, verify=False) for k, p in bundles.items()}
    prompts = load_prompts(sessions["int8"])
    for session in sessions.values():  # warm-up: first calls, page faults
        for depth in DEPTHS:
            session.generate(prompts[0], 16, mtp=depth, stop_ids=(), interruptible=False)
    runs = []
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", file=sys.stderr, flush=True)
        for p, prompt in enumerate(prompts):
            for depth in DEPTHS:
                for kind, session in sessions.items():
                    session.reset()
                    result = session.generate(
                        prompt, tokens, mtp=depth, stop_ids=(), interruptible=False
                    )
                    metrics = result.metrics()
                    runs.append({
                        "round": r, "prompt": p, "depth": depth, "activations": kind,
                        "decode_tok_s": metrics["decode_tok_s"],
                        "acceptance": metrics["acceptance_rate"], "tokens": result.tokens,
                    })  # fmt: skip
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    median = {
        (k, d): statistics.median(
            r["decode_tok_s"] for r in runs if r["activations"] == k and r["depth"] == d
        )
        for k in KINDS
        for d in DEPTHS
    }
    for depth in DEPTHS:
        pairs = {}
        for r in runs:
            if r["depth"] == depth:
                pairs.setdefault((r["round"], r["prompt"]), {})[r["activations"]] = r["tokens"]
        same = sum(p["int8"] == p["fp32"] for p in pairs.values())
        rows.append({
            "depth": depth,
            **{f"{k}_tok_s": median[(k, depth)] for k in KINDS},
            "int8_over_fp32": median[("int8", depth)] / median[("fp32", depth)],
            **{f"{k}_vs_own_ar": median[(k, depth)] / median[(k, 0)] for k in KINDS},
            "same_tokens": f"{same}/{len(pairs)}",
        })  # fmt: skip
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [
        "# ONNX cpu: int8 vs fp32 activations (embedded pair, Q4_0)",
        "",
        f"`{result['command']}`; {result['machine']['cpu']}, 1 thread; median of "
        f"{result['repeat']} rounds x {result['prompts']} prompts, {result['tokens']} tokens.",
        "",
        "| depth | int8 tok/s | fp32 tok/s | int8 / fp32 | int8 vs its AR | fp32 vs its AR "
        "| same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['depth']} | {r['int8_tok_s']:.1f} | {r['fp32_tok_s']:.1f} | "
            f"{r['int8_over_fp32']:.2f}x | {r['int8_vs_own_ar']:.2f}x | "
            f"{r['fp32_vs_own_ar']:.2f}x | {r['same_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, kind in enumerate(KINDS):
        ax.bar([r["depth"] + (i - 0.5) * width for r in rows], [r[f"{kind}_tok_s"] for r in rows],
               width, label=f"--activations {kind}")  # fmt: skip
    ax.set_xticks(list(DEPTHS))
    ax.set_xlabel("draft depth (0 = AR)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("ONNX cpu bundle of the embedded pair")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/onnx-activations"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    bundles = export(args.work)
    runs = measure(bundles, args.repeat, args.tokens)
    result = {
        "command": command_line("onnx_activations.py"),
        "machine": machine(1),
        "repeat": args.repeat,
        "tokens": args.tokens,
        "prompts": len({r["prompt"] for r in runs}),
        "rows": summarize(runs),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
    }
    text = report(result)
    write_results(args.out / "onnx_activations", result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

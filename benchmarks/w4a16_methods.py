"""W4A16 round-to-nearest vs GPTQ on the same checkpoint and text: what the better rounding buys.

Quantizes with both methods (same group, calibration on the first part of the text, evaluation on
the rest), then runs the quantization report for each. Writes a table (MD), JSON and a PNG.

Usage:
  python benchmarks/w4a16_methods.py --model M --text FILE [--group 128] [--work /tmp/w4]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from harness import pyplot, save_figure, write_results

from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.gptq import collect_hessians
from edgemtp.quantize.load import load_target
from edgemtp.runtime.quality import build_report
from edgemtp.runtime.tokenizer import token_file


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True, help="text, or token ids without tokenizer")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path("/tmp/w4a16-methods"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/w4a16_methods"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    ids = token_file(args.text, args.model, args.calib_tokens + args.eval_tokens + 1)
    calib, held_out = ids[: args.calib_tokens], ids[args.calib_tokens :]
    reference = load_target(args.model)
    with torch.no_grad():
        hessians = collect_hessians(
            reference, [calib[i : i + 512] for i in range(0, len(calib), 512)]
        )
    rows = {}
    for method in ("rtn", "gptq"):
        out = args.work / method
        settings = Settings(scheme="w4a16", group_size=args.group, method=method)
        quantize_checkpoint(
            args.model, out, settings, hessians if method == "gptq" else None, overwrite=True
        )
        with torch.no_grad():
            report = build_report(reference, load_target(out), held_out)
        rows[method] = report.as_dict()
        print(f"{method}:\n{report.table()}\n", file=sys.stderr)
    lines = [
        "| method | KL nats/token | top-1 agreement | ppl float | ppl quantized "
        "| mean weight error |",
        "|---|---|---|---|---|---|",
    ]
    for method, r in rows.items():
        err = sum(r["weight_error"].values()) / len(r["weight_error"])
        lines.append(
            f"| {method} | {r['kl_mean']:.5f} | {r['top1_agreement']:.2%} | {r['ppl_float']:.3f} "
            f"| {r['ppl_quantized']:.3f} | {err:.4f} |"
        )
    table = "\n".join(lines)
    print(table)
    result = {
        "command": " ".join(sys.argv),
        "group": args.group,
        "calib_tokens": len(calib),
        "eval_tokens": len(held_out),
        "results": rows,
    }
    # --out's own suffix, if it has one, gives way to .json/.md/.png, as it always has
    write_results(args.out.with_suffix(""), result, table + "\n", partial(plot, rows))


def plot(rows: dict, path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    methods = list(rows)
    a.bar(methods, [rows[m]["kl_mean"] for m in methods], color=["tab:gray", "tab:blue"])
    a.set_ylabel("KL(float || quantized), nats/token")
    b.bar(
        methods, [rows[m]["top1_agreement"] * 100 for m in methods], color=["tab:gray", "tab:blue"]
    )
    b.set_ylabel("top-1 agreement with float, %")
    fig.suptitle("W4A16: round-to-nearest vs GPTQ (held-out tokens)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()

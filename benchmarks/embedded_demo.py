"""`edgemtp demo` as a benchmark: AR vs MTP decode speed of the embedded pair's Q4_0 ExecuTorch
bundle at each draft depth, with where the time goes.

    python benchmarks/embedded_demo.py [--bundle DIR] [--depths 1 2 3] [--repeat 5] [--tokens 128]
        [--out embedded_demo]

For each depth, `cli.demo.run_demo` (the demo's own code: held-out prompts, AR and MTP
interleaved on identical inputs, warm-up excluded, medians of `--repeat` runs of every prompt,
greedy MTP tokens checked equal to AR's) on one bundle exported for the deepest depth (shallower
rounds are left-padded into its verify method, as the runtime does). Writes
benchmarks/results/<out>.{json,md,png}: tok/s by depth and the decode time per token
split by phase (target calls, drafter calls, embedding lookups, sampling, the host loop).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from functools import partial
from pathlib import Path

from harness import RESULTS, machine, pyplot, save_figure, write_results

from edgemtp.cli.demo import DemoSettings, run_demo
from edgemtp.model.embedded import ASSISTANT, TARGET


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    runs = result["runs"]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(11, 4))
    depths = [r["depth"] for r in runs]
    speed.plot(depths, [r["mtp_decode_tok_s"] for r in runs], "o-", label="MTP")
    speed.plot(depths, [r["ar_decode_tok_s"] for r in runs], "s--", label="AR (same run)")
    speed.set_xlabel("draft depth")
    speed.set_ylabel("decode tok/s (median)")
    speed.set_xticks(depths)
    speed.set_ylim(bottom=0)
    speed.legend()
    speed.set_title("embedded pair, Q4_0 ExecuTorch, 1 thread")
    bars = [("AR", runs[-1]["decode_ms_per_token_by_phase"]["ar"])] + [
        (f"MTP {r['depth']}", r["decode_ms_per_token_by_phase"]["mtp"]) for r in runs
    ]
    phases = ["target", "drafter", "embed", "sampling", "host"]
    bottom = [0.0] * len(bars)
    for phase in phases:
        values = [b[1].get(phase, 0.0) for b in bars]
        split.bar([b[0] for b in bars], values, bottom=bottom, label=phase)
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    split.set_ylabel("decode ms per committed token")
    split.set_title("where decode time goes")
    split.legend(fontsize=8)
    save_figure(fig, path)


def report(result: dict) -> str:
    lines = [
        "# The embedded demo pair: MTP vs AR",
        "",
        f"`{result['command']}` ({result['date']}, {result['machine']['cpu']}, 1 thread)",
        "",
        "| depth | AR tok/s | MTP tok/s | speed-up | committed / forward |"
        " runs with MTP tokens = AR | AR ms/token: target, embed, host+sampling |"
        " MTP ms/token: target, drafter, embed, host+sampling |",
        "|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in result["runs"]:
        ar, mtp = r["decode_ms_per_token_by_phase"]["ar"], r["decode_ms_per_token_by_phase"]["mtp"]
        lines.append(
            f"| {r['depth']} | {r['ar_decode_tok_s']:.0f} | {r['mtp_decode_tok_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['mean_committed_per_forward']:.2f} | "
            f"{r['mtp_runs_equal_ar']}/{r['runs'] * r['prompts']} | "
            f"{ar['target']:.3f}, {ar['embed']:.3f}, "
            f"{ar['host'] + ar['sampling']:.3f} | {mtp['target']:.3f}, {mtp['drafter']:.3f}, "
            f"{mtp['embed']:.3f}, {mtp['host'] + mtp['sampling']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="the demo bundle (exported when missing)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default="embedded_demo", help="results name under results/")
    args = parser.parse_args()

    deepest = max(args.depths)
    runs = []
    for depth in sorted(args.depths):
        settings = DemoSettings(depth=deepest, tokens=args.tokens, repeat=args.repeat)
        print(f"depth {depth}", file=sys.stderr, flush=True)
        r = run_demo(TARGET, ASSISTANT, args.bundle, settings, mtp_depth=depth)
        r.pop("prompt")
        runs.append(r)
        print(
            f"depth {depth}: AR {r['ar_decode_tok_s']:.0f} tok/s, MTP "
            f"{r['mtp_decode_tok_s']:.0f} tok/s ({r['speedup']:.2f}x), "
            f"{r['mean_committed_per_forward']:.2f} per forward",
            file=sys.stderr,
        )
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": machine(1),
        "runs": runs,
    }
    text = report(result)
    write_results(RESULTS / args.out, result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

"""edgemtp's attention kernel alone, ns per attended key: this tree's against another commit's.

    python benchmarks/attention_kernel.py [--against REV] [--rounds 7] [--calls 200]
        [--variant x86-64-v3]

Compiles `attention_kernel.cpp` (beside this script) against `runtime/kernels/`'s headers of
this tree and, with `--against`, of REV (`git show`), with the flags of edgemtp's kernel library
for `--variant` (`native.py`), and runs the binaries alternately, `--rounds` rounds of `--calls`
calls per case, one thread: the median of the rounds' medians per case, and the ratio this /
REV of each round, paired. Cases: one decode row of PEER-90M's layers at 1800 tokens of context
(4 query heads over one KV head: full layers 4 x 256 over 1800 keys, sliding ones 4 x 128 over
512), int8 and float16 caches, with the cache in the CPU's caches (hot) and pushed out of them
before each call (cold, as a decode step's weights push it out between two layers).
Writes OUT/attention_kernel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from harness import REPO, RESULTS, command_line, log, machine, pyplot, save_figure, write_results

from edgemtp.native import KERNELS, X86_VARIANTS

CASES = [f"{dtype}:{dim}:{keys}:{cold}" for dtype in ("i8", "f16")
         for dim, keys in ((256, 1800), (128, 512)) for cold in (0, 1)]  # fmt: skip


def build(headers: dict[str, str], flags: tuple[str, ...], out: Path) -> Path:
    """The driver compiled against `headers` (file name -> text)."""
    out.mkdir(parents=True)
    for name, text in headers.items():
        (out / name).write_text(text)
    binary = out / "attention_kernel"
    source = Path(__file__).with_name("attention_kernel.cpp")
    cmd = ["g++", "-O3", "-std=c++17", *flags, f"-I{out}", str(source), "-o", str(binary)]
    subprocess.run(cmd, check=True)
    return binary


def headers_at(rev: str | None) -> dict[str, str]:
    files = [Path(h).name for h in KERNELS.headers]
    if rev is None:
        return {f: (REPO / "runtime" / "kernels" / f).read_text() for f in files}
    show = ["git", "-C", str(REPO), "show"]
    return {
        f: subprocess.check_output([*show, f"{rev}:runtime/kernels/{f}"], text=True) for f in files
    }


def run(binary: Path, calls: int) -> dict[str, float]:
    lines = subprocess.check_output([str(binary), str(calls), *CASES], text=True).splitlines()
    return {case: float(line.split()[-1]) for case, line in zip(CASES, lines, strict=True)}


def label(case: str) -> str:
    dtype, dim, keys, cold = case.split(":")
    cache = {"i8": "int8", "f16": "float16"}[dtype]
    return f"{cache}, 4 x {dim} over {keys} keys, {'cold' if int(cold) else 'hot'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", help="a commit whose kernel headers to compare with")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--variant", default="x86-64-v3", choices=[v.name for v in X86_VARIANTS])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    flags = next(v.flags for v in X86_VARIANTS if v.name == args.variant)
    trees = {"this": None} | ({"against": args.against} if args.against else {})
    with tempfile.TemporaryDirectory() as tmp:
        binaries = {
            name: build(headers_at(rev), flags, Path(tmp) / name) for name, rev in trees.items()
        }
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            for name, binary in binaries.items():
                rounds[name].append(run(binary, args.calls))
    median = {
        name: {c: statistics.median(x[c] for x in runs) for c in CASES}
        for name, runs in rounds.items()
    }
    result = {
        "command": command_line("attention_kernel.py"),
        "machine": machine(threads=1),
        "variant": args.variant,
        "against": args.against,
        "ns_per_key": median,
        "rounds": rounds,
    }
    head = ["case", "this (ns/key)"]
    if args.against:
        head += [f"{args.against} (ns/key)", "this / it (paired median, range)"]
        result["paired"] = {
            c: [a[c] / b[c] for a, b in zip(rounds["this"], rounds["against"], strict=True)]
            for c in CASES
        }
    lines = [f"`{result['command']}` ({result['machine']['cpu']}, {args.variant}, one thread)", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for c in CASES:
        row = [label(c), f"{median['this'][c]:.1f}"]
        if args.against:
            ratios = result["paired"][c]
            spread = f"({min(ratios):.2f}-{max(ratios):.2f})"
            row += [f"{median['against'][c]:.1f}", f"{statistics.median(ratios):.2f} {spread}"]
        lines.append("| " + " | ".join(row) + " |")

    def plot(path: Path) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(median)
        for i, (name, values) in enumerate(median.items()):
            xs = [j + i * width for j in range(len(CASES))]
            ax.bar(xs, [values[c] for c in CASES], width, label=trees[name] or "this tree")
        ax.set_xticks([j + width * (len(median) - 1) / 2 for j in range(len(CASES))])
        ax.set_xticklabels([label(c).replace(", ", "\n", 1) for c in CASES], fontsize=6)
        ax.set_ylabel("ns per attended key (one thread)")
        ax.legend()
        save_figure(fig, path)

    write_results(args.out / "attention_kernel", result, "\n".join(lines) + "\n", plot)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

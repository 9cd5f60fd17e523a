"""Quantize the full-size E2B preset and report size on disk, time and peak memory.

The published size of Google's QAT Q4_0 E2B is 3.1 GiB; this checks ours (Q4_0 linears and token
table, int8 per-row PLE table by default) and that quantizing fits this machine's memory.

Usage:
  python benchmarks/quantize_e2b.py --work /tmp/e2b-bench [--scheme q4_0] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import EDGEMTP, machine, write_json


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", type=Path, required=True, help="scratch folder (~13 GB free needed)")
    ap.add_argument("--scheme", default="q4_0", choices=["q4_0", "w4a16"])
    ap.add_argument("--embeddings", default="q4_0")
    ap.add_argument("--ple", default="int8")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quantize_e2b"))
    args = ap.parse_args()
    float_dir, quant_dir = args.work / "e2b", args.work / f"e2b-{args.scheme}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not (float_dir / "config.json").exists():
        print("writing the e2b preset (bf16, ~9.3 GB)...", file=sys.stderr, flush=True)
        run([*EDGEMTP, "synth", "--preset", "e2b", "--out", str(float_dir), "--force"])
    cmd = [
        *EDGEMTP,
        "quantize",
        "--model",
        str(float_dir),
        "--scheme",
        args.scheme,
        "--embeddings",
        args.embeddings,
        "--ple",
        args.ple,
        "--out",
        str(quant_dir),
        "--force",
    ]
    print("quantizing...", file=sys.stderr, flush=True)
    seconds = run(cmd)
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    size = sum(f.stat().st_size for f in quant_dir.iterdir() if f.suffix == ".safetensors")
    float_size = sum(f.stat().st_size for f in float_dir.iterdir() if f.suffix == ".safetensors")
    report = {
        "command": " ".join(sys.argv),
        "quantize_command": "edgemtp " + " ".join(cmd[3:]),
        "machine": machine(fields=("cpu", "python")),
        "scheme": args.scheme,
        "embeddings": args.embeddings,
        "ple": args.ple,
        "float_bf16_gib": float_size / 2**30,
        "quantized_gib": size / 2**30,
        "published_qat_q4_0_gib": 3.1,
        "within_10_percent": abs(size / 2**30 - 3.1) <= 0.31,
        "seconds": seconds,
        "peak_rss_mb": peak_mb,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out.with_suffix(".json"), report)
    print(json.dumps(report, indent=1))
    if not args.keep:
        shutil.rmtree(quant_dir)


if __name__ == "__main__":
    main()

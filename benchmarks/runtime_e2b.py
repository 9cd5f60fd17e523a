"""Resident memory of a full-size E2B Q4_0 session (ExecuTorch, XNNPACK) against its bundle size.

A session over an export bundle maps `model.pte` and `tables.safetensors`; XNNPACK packs the
int4 weights into its own memory when each method loads; the host gathers embedding and PLE
rows from the mapped tables. This script loads the bundle in a fresh process, generates, and
reads from /proc/self/smaps what is resident and where: anonymous memory (packed weights, KV
cache, activations), the program file's pages, and the tables file's pages, which must grow with
the rows looked up only (the PLE table alone is 2.2 GiB). Each configuration runs in its own
process: with XNNPACK's weight cache (the runtime's default: every method that uses a weight
shares one packed copy) and without it (ExecuTorch's default: each method packs its own).

The bundle is the one `benchmarks/export_e2b.py` writes:
  edgemtp synth --preset e2b --out E2B && edgemtp synth --preset e2b-assistant --out E2B-A
  edgemtp export --model E2B --drafter E2B-A --quant q4_0 --backend executorch --delegate cpu \\
      --max-context 1024 --out BUNDLE

Usage: python benchmarks/runtime_e2b.py --bundle BUNDLE [--tokens 32] [--prompt 64]
Writes benchmarks/results/runtime_e2b.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from harness import GIB, RESULTS, machine, pyplot, save_figure, write_results


def smaps_by_file(names: tuple[str, ...]) -> dict[str, float]:
    """Resident GiB of this process: anonymous, and per mapped file whose name ends with one of
    `names`."""
    out = {"anon": 0.0, **dict.fromkeys(names, 0.0)}
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            path = head[5] if len(head) > 5 else ""
            current = next((n for n in names if path.endswith(n)), None)
        elif line.startswith("Rss:") and current:
            out[current] += int(head[1]) * 1024 / GIB
        elif line.startswith("Anonymous:"):
            out["anon"] += int(head[1]) * 1024 / GIB
    return out


def child(bundle: Path, weight_cache: bool, prompt_len: int, tokens: int, threads: int) -> dict:
    import torch

    from edgemtp.runtime.bundle import read_manifest
    from edgemtp.runtime.probes import current_rss_mb, peak_rss_mb
    from edgemtp.runtime.session import Session

    torch.set_num_threads(1)
    files = ("model.pte", "tables.safetensors")
    t0 = time.perf_counter()
    session = Session.from_bundle(bundle, threads=threads, verify=False, weight_cache=weight_cache)
    load_s = time.perf_counter() - t0
    loaded = {"rss_gib": current_rss_mb() / 1024, **smaps_by_file(files)}
    peak_load = peak_rss_mb() / 1024
    vocab = session.backend.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    with torch.no_grad():
        result = session.generate(prompt, tokens, mtp=0, stop_ids=())
    metrics = result.metrics()
    after = {"rss_gib": current_rss_mb() / 1024, **smaps_by_file(files)}
    manifest = read_manifest(bundle)
    sizes = {name: f["bytes"] / GIB for name, f in manifest["files"].items()}
    return {
        "weight_cache": weight_cache,
        "weight_cache_active": session.info["weight_cache"],
        "threads": threads,
        "load_s": load_s,
        "after_load": loaded,
        "peak_during_load_gib": peak_load,
        "after_generate": after,
        "peak_gib": peak_rss_mb() / 1024,
        "bundle_gib": sum(sizes.values()),
        "file_gib": {n: sizes[n] for n in files},
        "ple_rows_touched": len(set(prompt) | set(result.tokens)),
        "decode_tok_s": metrics["decode_tok_s"],
        "prefill_tok_s": metrics["prefill_tok_s"],
        "prompt_tokens": prompt_len,
        "generated_tokens": len(result.tokens),
    }


def machine_line() -> str:
    """The host in one line of the report (this result's JSON records no machine)."""
    m = machine(fields=("cpu", "cores", "memory_gib", "os", "torch", "executorch"))
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']:.1f} GiB RAM; {m['os']}; "
        f"torch {m['torch']}, executorch {m['executorch']}"
    )


def report(runs: list[dict], command: str) -> str:
    bundle = runs[0]["bundle_gib"]
    lines = [
        "# Full-size E2B Q4_0 session memory (ExecuTorch, XNNPACK, cpu delegate)",
        "",
        f"Run {datetime.date.today()} on {machine_line()}.",
        f"Bundle: {bundle:.2f} GiB (model.pte {runs[0]['file_gib']['model.pte']:.2f} GiB, "
        f"tables.safetensors {runs[0]['file_gib']['tables.safetensors']:.2f} GiB: token "
        "table q4_0 + PLE table int8). "
        f"Prompt {runs[0]['prompt_tokens']} tokens, {runs[0]['generated_tokens']} generated "
        f"(AR), {runs[0]['threads']} XNNPACK threads.",
        "",
        "| XNNPACK weight cache | RSS after load | peak during load | RSS after generate | "
        "anon | model.pte resident | tables resident | RSS / bundle | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        a = r["after_generate"]
        lines.append(
            f"| {'on (edgemtp default)' if r['weight_cache'] else 'off (ExecuTorch default)'} "
            f"| {r['after_load']['rss_gib']:.2f} GiB | {r['peak_during_load_gib']:.2f} GiB "
            f"| {a['rss_gib']:.2f} GiB | {a['anon']:.2f} GiB | {a['model.pte']:.2f} GiB "
            f"| {1024 * a['tables.safetensors']:.1f} MiB ({r['ple_rows_touched']} rows looked "
            f"up) | {a['rss_gib'] / bundle:.0%} | {r['decode_tok_s']:.2f} |"
        )
    lines += [
        "",
        "RSS and the split come from /proc/self/smaps of the session's process: `anon` is "
        "memory the kernel cannot drop (packed weights, KV cache, activations); file pages are "
        "the mapped program and tables. Peak is the kernel's ru_maxrss. Decode tok/s is one "
        "run on a shared 2-core host (indicative; the benchmark is about memory).",
        "",
        "## Command",
        "",
        f"```bash\n{command}\n```",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = ["weight cache on\n(edgemtp)", "weight cache off\n(ExecuTorch default)"]
    labels = [labels[0] if r["weight_cache"] else labels[1] for r in runs]
    parts = [
        ("anon", "anonymous (packed weights, cache)"),
        ("model.pte", "model.pte pages"),
        ("tables.safetensors", "tables pages"),
    ]
    left = [0.0] * len(runs)
    for key, name in parts:
        values = [r["after_generate"][key] for r in runs]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.axvline(runs[0]["bundle_gib"], color="k", ls="--", lw=1, label="bundle size")
    ax.set_xlabel("resident GiB after generating")
    ax.set_title("Full-size E2B Q4_0 session, ExecuTorch XNNPACK")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = child(args.bundle, args.child == "on", args.prompt, args.tokens, args.threads)
        print(json.dumps(run))
        return 0
    runs = []
    for mode in ("on", "off"):
        print(f"weight cache {mode}: loading {args.bundle} in a fresh process", file=sys.stderr)
        cmd = [sys.executable, __file__, "--bundle", str(args.bundle), "--child", mode]
        cmd += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]["after_generate"]), file=sys.stderr)
    command = f"python benchmarks/runtime_e2b.py --bundle {args.bundle} --prompt {args.prompt} "
    command += f"--tokens {args.tokens} --threads {args.threads}"
    text = report(runs, command)
    write_results(RESULTS / "runtime_e2b", {"runs": runs}, text, partial(plot, runs))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full-size E2B (or E4B) Q4_0 AR decode against this machine's memory-bandwidth roofline.

    python benchmarks/roofline_e2b.py --work /work/e2b [--threads 2] [--repeat 5]
        [--prompt 64] [--tokens 128] [--out benchmarks/results]
        [--preset e4b --bundle BUNDLE [--reference Q4_0_CHECKPOINT] [--mtp]]

Builds under --work, once (8 to 35 minutes by host, and 19 GiB of memory, most of it
ExecuTorch's lowering):

    edgemtp synth --preset e2b --out WORK/e2b
    edgemtp export --model WORK/e2b --quant q4_0 --backend executorch --delegate cpu \\
        --max-context 1024 --prefill-chunk 128 --out WORK/bundle

(target only: AR decode needs no drafter). Then, in this process, one session over the bundle
with N threads, and per repeat, alternating: the machine's read bandwidth, measured in a fresh
process with the same N threads (`--probe`: a float32 array 8x the last-level cache summed
again and again, median pass; a fresh process so that its buffer never counts toward the
session's RSS), then greedy AR decoding of `--tokens` after a fresh random `--prompt`. A
token's bytes are what the simulator counts for one decode step of this bundle at the run's
middle position: every weight at the bits a decode step reads (a kernel bundle's Q4_0 kernel:
the checkpoint's blocks, 4-bit codes and a float16 scale per 32; otherwise as the program stores
them: 4-bit codes, bf16 scales, the offset blocks of negative Q4_0 scales), the LM head included,
and the K/V the static program reads. Roofline tok/s = bandwidth / bytes per token; each
repeat's fraction compares the two measured side by side. Peak RSS: this process's high-water mark.
With `--bundle`, an existing bundle is measured (`--preset` names the model). `--reference`:
the bundle's first `--check-tokens` greedy tokens fed to the reference engine on that Q4_0
checkpoint (the weights the bundle was exported from; loaded without float copies, each linear
dequantized on use): how many are its greedy picks, and how far the others are. `--mtp`: each
repeat also decodes the same prompt with `--mtp auto` (the bundle's drafter), side by side with
its AR decode.
Writes OUT/roofline_PRESET.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from harness import EDGEMTP, RESULTS, log, machine, pyplot, save_figure, write_results

GOAL = 0.70  # issue 7: AR decode at >= 70 % of the memory-bandwidth roofline


def build(work: Path, preset: str = "e2b") -> Path:
    checkpoint, bundle = work / preset, work / "bundle"
    if not (checkpoint / "config.json").is_file():
        log(f"synthesizing the full-size {preset} checkpoint (random weights, bf16)")
        subprocess.run(
            [*EDGEMTP, "synth", "--preset", preset, "--out", str(checkpoint)], check=True
        )
    if not (bundle / "manifest.json").is_file():
        log("exporting it (Q4_0, ExecuTorch XNNPACK): about 35 minutes here")
        subprocess.run([*EDGEMTP, "export", "--model", str(checkpoint), "--quant", "q4_0",
                        "--backend", "executorch", "--delegate", "cpu", "--max-context", "1024",
                        "--prefill-chunk", "128", "--out", str(bundle)], check=True)  # fmt: skip
    return bundle


def read_bandwidth_gbs(threads: int, passes: int = 7) -> float:
    """GB/s of `threads` threads reading a float32 array 8x the last-level cache (at least
    1 GiB): torch's sum, one read of every byte per pass, median of `passes` after one warm-up."""
    import torch

    from edgemtp.devices.calibrate.host import resident_mb

    torch.set_num_threads(threads)
    llc_mb = 2 * (resident_mb() or 16)
    data = torch.ones(max(2**30, int(8 * llc_mb * 2**20)) // 4)
    data.sum()
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(seconds) / 1e9


def probe_in_fresh_process(threads: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    return float(out.stdout.strip().splitlines()[-1])


def bytes_per_token(bundle: Path, position: int) -> dict[str, float]:
    """The simulator's count for one AR decode step of `bundle` at `position`."""
    from edgemtp.devices.simulator import model_from_bundle
    from edgemtp.model.cost import forward_work

    model = model_from_bundle(bundle)
    rows = range(position, position + 1)
    work = forward_work(model.target, rows, 1, 1, model.step_bits, model.cache_keys(position + 1))
    return {
        "total": work.bytes,
        "weights": work.weight_bytes,
        "kv_cache": work.cache_bytes,
        "bits_per_weight": model.step_bits,
    }


def reference_picks(checkpoint: Path, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """The reference engine fed `prompt` + `tokens` (teacher-forced, one forward over every row,
    `checkpoint`'s Q4_0 weights dequantized on use, no float copy held): at each of `tokens`,
    whether it is the reference's greedy pick, and the gap between the reference's best logit
    and its logit relative to the logit range (0 where the pick agrees). A bundle whose
    activations are quantized (int8) may pick the other side of a near-tie; a broken one
    picks tokens far from the reference's choice."""
    import torch

    from edgemtp.model.cache import KVCache
    from edgemtp.model.forward import forward_rows
    from edgemtp.quantize.load import load_target

    log(f"reference engine on {checkpoint}: {len(tokens)} tokens teacher-forced")
    start = time.perf_counter()
    target = load_target(checkpoint, float_4bit=False)
    cache = KVCache(target.cfg, len(prompt) + len(tokens), 0, target.form.cache_dtype)
    with torch.no_grad():
        hidden = forward_rows(target, cache, torch.tensor(prompt + tokens[:-1]), "all")
        assert hidden is not None
        logits = target.model.logits(hidden[len(prompt) - 1 :], target.form.step)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gaps = ((logits.max(-1).values - chosen) / logits.abs().amax(-1)).tolist()
    picks = logits.argmax(-1).tolist()
    agree = [a == b for a, b in zip(picks, tokens, strict=True)]
    first = agree.index(False) if False in agree else None
    return {
        "reference_picks": picks,
        "agree": sum(agree),
        "first_differ": first,
        "max_gap": max(gaps),
        "gaps_where_differ": [round(g, 5) for g, a in zip(gaps, agree, strict=True) if not a],
        "seconds": time.perf_counter() - start,
    }


def measure(bundle: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from edgemtp.runtime.probes import current_rss_mb, peak_rss_mb
    from edgemtp.runtime.session import Session

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((bundle / "manifest.json").read_text())["model"]["vocab_size"]
    first_prompt = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
    log(f"loading {bundle} ({args.threads} threads)")
    start = time.perf_counter()
    session = Session.from_bundle(bundle, threads=args.threads, verify=False)
    load_s = time.perf_counter() - start
    per_token = bytes_per_token(bundle, args.prompt + args.tokens // 2)
    tokens_check = None
    if args.reference:
        with torch.no_grad():
            got = session.generate(first_prompt, args.check_tokens, mtp=0, stop_ids=()).tokens
        tokens_check = {"bundle": got, **reference_picks(args.reference, first_prompt, got)}
        log(
            f"tokens vs the reference engine: {tokens_check['agree']}/{len(got)} its greedy "
            f"picks, largest relative gap {tokens_check['max_gap']:.4f}"
        )

    def decode(prompt: list[int], mtp: int | str) -> dict[str, Any]:
        with torch.no_grad():
            result = session.generate(prompt, args.tokens, mtp=mtp, stop_ids=())
        m = result.metrics()
        steps = m["decode_forwards"]
        phases = {k: 1000 * v / steps for k, v in m["decode_seconds_by_phase"].items()}
        out = {"tok_s": m["decode_tok_s"], "ms_per_step": phases, "tokens": result.tokens}
        if mtp != 0:
            out["tokens_per_forward"] = len(result.tokens) / steps
        return out

    log("warm-up decode (not counted)")
    decode(first_prompt, 0)
    if args.mtp:
        decode(first_prompt, "auto")
    runs = []
    for r in range(args.repeat):
        bandwidth = probe_in_fresh_process(args.threads)
        prompt = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
        run = decode(prompt, 0)
        achieved = run["tok_s"] * per_token["total"] / 1e9
        runs.append({"bandwidth_gbs": bandwidth, **run, "achieved_gbs": achieved,
                     "fraction": achieved / bandwidth})  # fmt: skip
        line = (
            f"repeat {r + 1}/{args.repeat}: read bandwidth {bandwidth:.1f} GB/s, decode "
            f"{run['tok_s']:.2f} tok/s = {achieved:.1f} GB/s ({achieved / bandwidth:.0%})"
        )
        if args.mtp:
            mtp = decode(prompt, "auto")
            runs[-1]["mtp"] = {k: mtp[k] for k in ("tok_s", "tokens_per_forward")}
            runs[-1]["mtp"]["same_tokens"] = mtp["tokens"] == run["tokens"]
            runs[-1]["mtp"]["ratio"] = mtp["tok_s"] / run["tok_s"]
            line += f"; --mtp auto {mtp['tok_s']:.2f} tok/s ({mtp['tok_s'] / run['tok_s']:.2f}x)"
        del run["tokens"]
        log(line)
    return {
        "tokens_check": tokens_check,
        "load_s": load_s,
        "bytes_per_token": per_token,
        "runs": runs,
        "peak_rss_gib": peak_rss_mb() / 1024,
        "rss_after_gib": current_rss_mb() / 1024,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["runs"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    fractions = [r["fraction"] for r in runs]
    mtp = {}
    if all("mtp" in r for r in runs):
        mtp = {
            "mtp_tok_s": statistics.median(r["mtp"]["tok_s"] for r in runs),
            "mtp_ratio": statistics.median(r["mtp"]["ratio"] for r in runs),
            "mtp_tokens_per_forward": statistics.median(
                r["mtp"]["tokens_per_forward"] for r in runs
            ),
            "mtp_same_tokens": all(r["mtp"]["same_tokens"] for r in runs),
        }
    return {
        **mtp,
        "tok_s": med("tok_s"),
        "bandwidth_gbs": med("bandwidth_gbs"),
        "achieved_gbs": med("achieved_gbs"),
        "roofline_tok_s": med("bandwidth_gbs") * 1e9 / result["bytes_per_token"]["total"],
        "fraction": statistics.median(fractions),
        "fraction_range": [min(fractions), max(fractions)],
        "meets_goal": statistics.median(fractions) >= GOAL,
    }


def report(doc: dict[str, Any]) -> str:
    s, b = doc["summary"], doc["bytes_per_token"]
    gib = 2**30
    lines = [
        f"# Full-size {doc.get('preset', 'e2b').upper()} Q4_0 AR decode against the "
        "memory-bandwidth roofline",
        "",
        f"`{doc['command']}` ({doc['date']}; {doc['machine']['cpu']}, "
        f"{doc['machine']['cores']} cores; {doc['threads']} threads, "
        f"prompt {doc['prompt']}, {doc['tokens']} tokens AR, {len(doc['runs'])} repeats)",
        "",
        f"Bytes per token (the simulator's count for this bundle at position "
        f"{doc['prompt'] + doc['tokens'] // 2}): {b['total'] / gib:.3f} GiB = weights "
        f"{b['weights'] / gib:.3f} GiB at {b['bits_per_weight']:.2f} bits per linear weight "
        f"(LM head included) + K/V {b['kv_cache'] / 2**20:.1f} MiB.",
        "",
        "| repeat | read bandwidth GB/s | decode tok/s | roofline tok/s | achieved GB/s | "
        "fraction | ms per step: target / embed / sampling / host |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(doc["runs"], 1):
        ms = r["ms_per_step"]
        lines.append(
            f"| {i} | {r['bandwidth_gbs']:.1f} | {r['tok_s']:.2f} | "
            f"{r['bandwidth_gbs'] * 1e9 / b['total']:.2f} | {r['achieved_gbs']:.1f} | "
            f"{r['fraction']:.0%} | {ms['target']:.1f} / {ms['embed']:.2f} / "
            f"{ms['sampling']:.2f} / {ms['host']:.2f} |"
        )
    lo, hi = s["fraction_range"]
    lines += [
        f"| **median** | **{s['bandwidth_gbs']:.1f}** | **{s['tok_s']:.2f}** | "
        f"**{s['roofline_tok_s']:.2f}** | **{s['achieved_gbs']:.1f}** | **{s['fraction']:.0%}** "
        "| |",
        "",
        f"Fraction of the roofline: median {s['fraction']:.0%} (range {lo:.0%}-{hi:.0%}); goal "
        f">= {GOAL:.0%}: {'met' if s['meets_goal'] else 'missed'}. Peak RSS "
        f"{doc['peak_rss_gib']:.2f} GiB (after decoding {doc['rss_after_gib']:.2f} GiB; "
        f"bundle loaded in {doc['load_s']:.0f} s).",
    ]
    if "mtp_ratio" in s:
        ratios = ", ".join(f"{r['mtp']['ratio']:.2f}" for r in doc["runs"])
        lines += [
            "",
            f"`--mtp auto` on the same prompts, side by side with each AR decode: median "
            f"{s['mtp_tok_s']:.2f} tok/s, **{s['mtp_ratio']:.2f}x AR** (repeats {ratios}), "
            f"{s['mtp_tokens_per_forward']:.2f} tokens per target forward; tokens equal to "
            f"AR's in every repeat: {s['mtp_same_tokens']}.",
        ]
    check = doc.get("tokens_check")
    if check:
        n = len(check["bundle"])
        differ = (
            f"; where not, the reference's best logit is ahead of the bundle's pick by "
            f"{', '.join(f'{g:.2%}' for g in check['gaps_where_differ'])} of its logit range "
            f"(first at token {check['first_differ']})"
            if check["first_differ"] is not None
            else ""
        )
        lines += [
            "",
            f"Greedy tokens against the reference engine on the same Q4_0 weights: the bundle's "
            f"{n} AR tokens after the first prompt, fed to the reference (teacher-forced, "
            f"{check['seconds']:.0f} s): **{check['agree']}/{n} are its greedy picks**{differ}.",
        ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    runs, total = doc["runs"], doc["bytes_per_token"]["total"]
    x = range(1, len(runs) + 1)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar([i - 0.2 for i in x], [r["bandwidth_gbs"] * 1e9 / total for r in runs], 0.4,
           label="roofline (read bandwidth / bytes per token)", color="tab:gray")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["tok_s"] for r in runs], 0.4, label="edgemtp AR decode",
           color="tab:blue")  # fmt: skip
    for i, r in zip(x, runs, strict=True):
        ax.annotate(f"{r['fraction']:.0%}", (i + 0.2, r["tok_s"]), ha="center", va="bottom")
    ax.set_xlabel("repeat (bandwidth measured just before each decode)")
    ax.set_ylabel("tok/s")
    model = doc.get("preset", "e2b").upper()
    ax.set_title(f"Full-size {model} Q4_0, {doc['threads']} threads: decode vs roofline")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/edgemtp-e2b"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--preset", choices=["e2b", "e4b"], default="e2b")
    p.add_argument("--bundle", type=Path, help="measure this bundle (no build)")
    p.add_argument("--reference", type=Path, help="Q4_0 checkpoint: tokens vs the reference")
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--mtp", action="store_true", help="also --mtp auto, side by side")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        print(read_bandwidth_gbs(args.threads))
        return
    bundle = args.bundle or build(args.work, args.preset)
    result = measure(bundle, args)
    doc = {
        "command": "python benchmarks/roofline_e2b.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine(args.threads),
        "preset": args.preset,
        "threads": args.threads,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "bundle": str(bundle),
        **result,
    }
    doc["summary"] = summary(doc)
    text = report(doc)
    write_results(args.out / f"roofline_{args.preset}", doc, text, partial(plot, doc))
    print(text)


if __name__ == "__main__":
    main()

"""Prefill pruning of the KV-shared layers, and the prefill cost of attaching the MTP drafter.

Measures, side by side in one run (interleaved, medians of --repeats, unique prompts each run):
  - prefill tok/s unpruned vs pruned at each length, their ratio, and the ratio of matmul work
    the pruning skips (model.cost);
  - prefill tok/s and TTFT with the drafter attached (MTP depth 2) vs without: the drafter reads
    the target's caches, so it must add nothing to prefill.

Usage (see benchmarks/README.md for the committed run):
  python benchmarks/prefill_pruning.py --model M --drafter D --lengths 512 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from harness import machine, pyplot, save_figure, write_results

from edgemtp.model.cache import KVCache
from edgemtp.model.cost import prefill_flops
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.generate import generate, prefill


def timed_prefill(target, ids: torch.Tensor, chunk: int, prune: bool) -> float:
    cache = KVCache(target.cfg, ids.shape[0] + 8)
    t0 = time.perf_counter()
    prefill(target, cache, ids, chunk=chunk, prune=prune)
    return ids.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_pruning"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out's JSON")
    args = ap.parse_args()
    if args.plot_only:
        report = json.loads(args.out.with_suffix(".json").read_text())
        plot(report["results"], report["shape"], args.out.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target.cfg)
    cfg = target.cfg
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> torch.Tensor:  # a fresh prompt for every run
        return torch.randint(3, vocab, (n,), generator=gen)

    results = []
    with torch.no_grad():
        timed_prefill(target, prompt(64), args.chunk, True)  # warm-up
        timed_prefill(target, prompt(64), args.chunk, False)
        for length in args.lengths:
            runs: dict[str, list[float]] = {
                k: [] for k in ("unpruned", "pruned", "ttft_ar", "ttft_mtp", "pp_ar", "pp_mtp")
            }
            for r in range(args.repeats):
                print(f"pp{length}: run {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
                runs["unpruned"].append(timed_prefill(target, prompt(length), args.chunk, False))
                runs["pruned"].append(timed_prefill(target, prompt(length), args.chunk, True))
                p = prompt(length).tolist()
                ar = generate(target, p, 3, prefill_chunk=args.chunk).metrics()
                mtp = generate(
                    target, p, 3, drafter=drafter, mtp_depth=2, prefill_chunk=args.chunk
                ).metrics()
                runs["ttft_ar"].append(ar["ttft_s"])
                runs["ttft_mtp"].append(mtp["ttft_s"])
                runs["pp_ar"].append(ar["prefill_tok_s"])
                runs["pp_mtp"].append(mtp["prefill_tok_s"])
            med = {k: statistics.median(v) for k, v in runs.items()}
            work = prefill_flops(cfg, length, args.chunk, False) / prefill_flops(
                cfg, length, args.chunk, True
            )
            results.append(
                {
                    "length": length,
                    "unpruned_tok_s": med["unpruned"],
                    "pruned_tok_s": med["pruned"],
                    "speedup": statistics.median(
                        p / u for p, u in zip(runs["pruned"], runs["unpruned"], strict=True)
                    ),
                    "work_ratio": work,
                    "prefill_tok_s_without_drafter": med["pp_ar"],
                    "prefill_tok_s_with_drafter": med["pp_mtp"],
                    "ttft_s_without_drafter": med["ttft_ar"],
                    "ttft_s_with_drafter": med["ttft_mtp"],
                    "runs": runs,
                }
            )

    shape = {
        "hidden": cfg.hidden_size,
        "layers": cfg.num_layers,
        "kv_shared_layers": cfg.num_kv_shared_layers,
        "store_layers": cfg.store_layers,
        "vocab": vocab,
        "window": cfg.sliding_window,
    }
    report = {
        "command": " ".join(sys.argv),
        "machine": machine(torch.get_num_threads(), ("cpu", "threads", "torch", "python")),
        "model": str(args.model),
        "shape": shape,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "results": results,
    }
    lines = [
        "| prompt | unpruned tok/s | pruned tok/s | speedup (measured) | work ratio (analytic) "
        "| prefill tok/s no drafter | with drafter | TTFT ms no drafter | with drafter |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| pp{r['length']} | {r['unpruned_tok_s']:.0f} | {r['pruned_tok_s']:.0f} "
            f"| {r['speedup']:.2f}x "
            f"| {r['work_ratio']:.2f}x | {r['prefill_tok_s_without_drafter']:.0f} "
            f"| {r['prefill_tok_s_with_drafter']:.0f} | {r['ttft_s_without_drafter'] * 1e3:.0f} "
            f"| {r['ttft_s_with_drafter'] * 1e3:.0f} |"
        )
    table = "\n".join(lines)
    # --out's own suffix, if it has one, gives way to .json/.md/.png, as it always has
    write_results(args.out.with_suffix(""), report, table + "\n", partial(plot, results, shape))
    print(table)


def plot(results: list[dict], shape: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"pp{r['length']}" for r in results]
    x = range(len(results))
    w = 0.2
    bars = [
        ("unpruned", "unpruned_tok_s"),
        ("pruned", "pruned_tok_s"),
        ("generate, no drafter", "prefill_tok_s_without_drafter"),
        ("generate, drafter attached", "prefill_tok_s_with_drafter"),
    ]
    for j, (label, key) in enumerate(bars):
        left.bar([i + (j - 1.5) * w for i in x], [r[key] for r in results], w, label=label)
    left.set_xticks(list(x), labels)
    left.set_ylabel("prefill tok/s (median)")
    left.legend(fontsize=8, loc="lower right")
    right.bar([i - 0.2 for i in x], [r["speedup"] for r in results], 0.4, label="measured speedup")
    right.bar(
        [i + 0.2 for i in x], [r["work_ratio"] for r in results], 0.4, label="work ratio (analytic)"
    )
    right.set_xticks(list(x), labels)
    right.set_ylabel("pruned / unpruned")
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"KV-shared prefill pruning, hidden {shape['hidden']}, {shape['layers']} layers "
        f"({shape['kv_shared_layers']} KV-shared)"
    )
    save_figure(fig, path)


if __name__ == "__main__":
    main()

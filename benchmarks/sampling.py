"""Cost of choosing one sampled token: edgemtp's sampler against transformers' on the same logits.

    OMP_NUM_THREADS=1 python benchmarks/sampling.py [--repeat 7] [--out DIR]

Per vocabulary size (8192, the demo pair's; 262144, Gemma 4's), logits shape (peaked: normal
with scale 8, where top-p 0.95 keeps a handful of tokens; spread: scale 2, where it keeps
thousands) and setting (temperature 0.8 with top-p 0.95; Gemma's temperature 1, top-k 64,
top-p 0.95), it times one token chosen from one row:

- edgemtp: `runtime.sampling.probabilities` then `sample`;
- transformers: its logits warpers (Temperature, TopK, TopP) then softmax and
  `torch.multinomial`, as `generate(do_sample=True)` does.

The two are timed interleaved in one process, `--repeat` rounds of `--calls` calls each; the
median per call is reported. Both must keep the same tokens (checked before timing). Writes
OUT/sampling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from harness import (
    RESULTS,
    command_line,
    machine,
    ms_per_call,
    pyplot,
    save_figure,
    write_results,
)

from edgemtp.runtime.sampling import SamplingParams, make_generator, probabilities, sample

VOCABS = (8192, 262144)
SHAPES = {"peaked": 8.0, "spread": 2.0}
SETTINGS = {
    "T0.8 top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "T1 top-k 64 top-p 0.95": SamplingParams(temperature=1.0, top_k=64, top_p=0.95),
}


def transformers_warpers(params: SamplingParams) -> list[Any]:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[Any] = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


def transformers_scores(warpers: list[Any], logits: torch.Tensor) -> torch.Tensor:
    scores = logits[None]
    for warper in warpers:
        scores = warper(None, scores)
    return scores[0]


def edgemtp_choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    return sample(probabilities(logits, params), generator)


def transformers_choose(
    logits: torch.Tensor, warpers: list[Any], generator: torch.Generator
) -> torch.Tensor:
    probs = transformers_scores(warpers, logits).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


def run(repeat: int, calls: int) -> list[dict[str, Any]]:
    rows = []
    for vocab in VOCABS:
        for shape, scale in SHAPES.items():
            logits = torch.randn(vocab, generator=make_generator(vocab)) * scale
            for name, params in SETTINGS.items():
                warpers = transformers_warpers(params)

                ours = functools.partial(edgemtp_choose, params=params, generator=make_generator(0))
                theirs = functools.partial(
                    transformers_choose, warpers=warpers, generator=make_generator(0)
                )
                kept = probabilities(logits, params) > 0
                if not torch.equal(kept, transformers_scores(warpers, logits) > -float("inf")):
                    raise SystemExit(f"kept tokens differ: vocab {vocab}, {shape}, {name}")
                times: dict[str, list[float]] = {"edgemtp": [], "transformers": []}
                ours(logits), theirs(logits)
                for _ in range(repeat):
                    times["edgemtp"].append(ms_per_call(partial(ours, logits), calls))
                    times["transformers"].append(ms_per_call(partial(theirs, logits), calls))
                row = {
                    "vocab": vocab,
                    "logits": shape,
                    "setting": name,
                    "kept_tokens": int(kept.sum()),
                    "ms": {k: statistics.median(v) for k, v in times.items()},
                    "runs_ms": times,
                }
                row["speedup"] = row["ms"]["transformers"] / row["ms"]["edgemtp"]
                rows.append(row)
                print(
                    f"vocab {vocab:>6} {shape:<6} {name:<24} kept {row['kept_tokens']:>6}  "
                    f"edgemtp {row['ms']['edgemtp']:7.3f} ms  "
                    f"transformers {row['ms']['transformers']:7.3f} ms  "
                    f"{row['speedup']:5.1f}x",
                    file=sys.stderr,
                )
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Sampling one token: edgemtp vs transformers",
        "",
        f"`{result['command']}` on {result['machine']['cpu']}, "
        f"{result['machine']['threads']} thread(s); median of {result['repeat']} rounds of "
        f"{result['calls']} calls.",
        "",
        "| vocab | logits | setting | kept tokens | edgemtp ms | transformers ms | speed-up |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['vocab']} | {r['logits']} | {r['setting']} | {r['kept_tokens']} | "
            f"{r['ms']['edgemtp']:.3f} | {r['ms']['transformers']:.3f} | "
            f"{r['speedup']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    labels = [f"{r['vocab']}\n{r['logits']}\n{r['setting']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["ms"]["edgemtp"] for r in rows], width, label="edgemtp")
    ax.bar(
        [i + width / 2 for i in x],
        [r["ms"]["transformers"] for r in rows],
        width,
        label="transformers warpers + multinomial",
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per sampled token (log)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_title("Choosing one sampled token from one logit row")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run(args.repeat, args.calls)
    result = {
        "command": command_line("sampling.py"),
        "machine": machine(torch.get_num_threads()),
        "repeat": args.repeat,
        "calls": args.calls,
        "rows": rows,
    }
    text = report(result)
    write_results(args.out / "sampling", result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

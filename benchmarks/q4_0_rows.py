"""What a verify row costs in edgemtp's Q4_0 kernel, at a model's own linear shapes.

    python benchmarks/q4_0_rows.py [--models embedded e2b] [--threads 1] [--repeat 7]
        [--out q4_0_rows]

A verify of k drafts runs the target on k + 1 rows, and a speculative round pays off only if
those rows cost much less than k + 1 single-row steps. For each linear the target and the
drafter run through `edgemtp::q4_0_linear` (shapes from the checkpoint config: every 2-D weight
`model.synth.tensor_specs` lists, the tied embedding as the LM head; the drafter's head as the
rows of its kept clusters), this times the kernel in one ExecuTorch program at 1..4 rows of x
(random codes and scales: the arithmetic does not depend on the values), subtracts the cost of a
call that does no work (a 32 x 32 linear), and sums the shapes over the model:

    linears(rows)   ms of the target's Q4_0 linears for one forward of `rows` rows
    draft           ms of the drafter's linears for one draft step

and, with the embedded pair's measured tokens committed per round at depth k
(`results/embedded_demo_rounds.json`), the speed-up the linears alone allow:

    committed_k * linears(1) / (linears(k + 1) + k * draft)

Attention, norms and the host are left out: they are small next to E2B's 1.7 G multiply-adds a
row, and measured per method for the embedded pair by `method_costs.py`. Outputs wider than
16384 rows (E2B's 262144-row head) are timed at 16384 and scaled: past the cache, a linear's
cost grows with its outputs.

Writes results/NAME.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from harness import RESULTS, command_line, machine, pyplot, save_figure, write_results

from edgemtp.export.executorch_program import (
    backend_config,
    export_method,
    lower_programs,
    xnnpack_partitioner,
)
from edgemtp.model.embedded import ASSISTANT, TARGET
from edgemtp.model.synth import preset_config, tensor_specs
from edgemtp.runtime import kernels
from edgemtp.runtime.kernels import ops  # noqa: F401  (registers edgemtp::q4_0_linear)

ROWS = (1, 2, 3, 4)
WIDEST = 16384  # outputs timed at most; wider linears are scaled from it
NO_WORK = (32, 32)  # the call whose cost (program call, Python binding) is subtracted
COMMITTED = RESULTS / "embedded_demo_rounds.json"


class Linear(torch.nn.Module):
    def forward(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgemtp.q4_0_linear(x, codes, scales)


def configs(name: str) -> tuple[dict, dict]:
    """(target, drafter) config.json dicts of a model pair."""
    if name == "embedded":
        return tuple(json.loads((d / "config.json").read_text()) for d in (TARGET, ASSISTANT))
    return preset_config(name), preset_config(f"{name}-assistant")


def target_linears(cfg: dict) -> Counter:
    """(in, out) -> count of the target's linears in one forward: every 2-D weight but the
    per-layer embedding table (a lookup); the tied token embedding is the LM head."""
    shapes: Counter = Counter()
    for spec in tensor_specs(cfg):
        if len(spec.shape) == 2 and spec.name != "model.embed_tokens_per_layer.weight":
            out, n_in = spec.shape
            shapes[(n_in, out)] += 1
    return shapes


def drafter_linears(cfg: dict) -> Counter:
    """(in, out) -> count for one draft step: the layers and projections, the centroid logits,
    then the kept clusters' rows of the head (not its whole vocabulary)."""
    text = cfg["text_config"]
    shapes: Counter = Counter()
    for spec in tensor_specs(cfg):
        if len(spec.shape) == 2 and spec.name != "model.embed_tokens.weight":
            out, n_in = spec.shape
            shapes[(n_in, out)] += 1
    kept = cfg["centroid_intermediate_top_k"] * text["vocab_size"] // cfg["num_centroids"]
    shapes[(text["hidden_size"], kept)] += 1
    return shapes


def timed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    n_in, out = shape
    return n_in, min(out, WIDEST)


def inputs(shape: tuple[int, int], rows: int) -> tuple[torch.Tensor, ...]:
    n_in, out = shape
    gen = torch.Generator().manual_seed(n_in * 7919 + out)
    codes = torch.randint(0, 256, (out, n_in // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out, n_in // 32, generator=gen) * 0.02).half()
    return torch.randn(rows, n_in, generator=gen), codes, scales


def time_shapes(
    shapes: set[tuple[int, int]], threads: int, repeat: int
) -> dict[tuple[int, int], list[float]]:
    """Median ms per call of each (in, out) at each row count, the no-work call subtracted."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(threads)  # the pool the kernel splits outputs over

    shapes = {*shapes, NO_WORK}
    calls = {(s, r): inputs(s, r) for s in shapes for r in ROWS}
    programs = {f"l{s[0]}x{s[1]}r{r}": export_method(Linear(), calls[(s, r)]) for s, r in calls}
    print(f"lowering {len(programs)} programs", file=sys.stderr)
    # (the loaded program reads this buffer: it must outlive the module)
    program = lower_programs(programs, lambda: [xnnpack_partitioner()])
    program = program.to_executorch(backend_config()).buffer
    kernels.load()
    module = portable_lib._load_for_executorch_from_buffer(program)
    samples: dict[tuple, list[float]] = {key: [] for key in calls}
    for rep in range(repeat):  # interleaved: drift on a shared machine hits every shape alike
        for (s, r), args in calls.items():
            name = f"l{s[0]}x{s[1]}r{r}"
            n = max(5, min(400, int(4e7 / (s[0] * s[1] * r))))
            module.run_method(name, args)
            start = time.perf_counter()
            for _ in range(n):
                module.run_method(name, args)
            samples[(s, r)].append((time.perf_counter() - start) * 1e3 / n)
        print(f"round {rep + 1}/{repeat}", file=sys.stderr)
    median = {key: statistics.median(v) for key, v in samples.items()}
    return {
        s: [max(0.0, median[(s, r)] - median[(NO_WORK, r)]) for r in ROWS]
        for s in shapes
        if s != NO_WORK
    }


def model_costs(target: Counter, drafter: Counter, cost: dict) -> tuple[list[float], float]:
    """(target linears ms per forward at each row count, drafter linears ms per step)."""

    def ms(shape: tuple[int, int], row: int) -> float:
        return cost[timed_shape(shape)][row] * shape[1] / timed_shape(shape)[1]

    rows = [sum(n * ms(s, i) for s, n in target.items()) for i in range(len(ROWS))]
    return rows, sum(n * ms(s, 0) for s, n in drafter.items())


def committed_by_depth() -> dict[int, float]:
    runs = json.loads(COMMITTED.read_text())["runs"]
    return {run["depth"]: run["mean_committed_per_forward"] for run in runs}


def report(result: dict) -> str:
    lines = [
        "# Q4_0 linears by verify rows, at the models' shapes",
        "",
        f"`{result['command']}`",
        "",
        f"{result['machine']['cpu']}, threads: {result['machine']['threads']}, {result['date']}; "
        f"medians of "
        f"{result['repeat']} interleaved rounds; tokens committed per round from "
        "`embedded_demo_rounds.json` (the embedded pair's measured acceptance).",
        "",
        "| model | MMAC per row | linears ms: 1 row | 2 | 3 | 4 rows | drafter step ms "
        "| speed-up d1 | d2 | d3 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["models"].items():
        rows = m["linears_ms"]
        ratios = " | ".join(f"{r:.2f} ({r / rows[0]:.2f}x)" for r in rows[1:])
        speed = " | ".join(f"{m['speedup_linears'][str(k)]:.2f}x" for k in (1, 2, 3))
        lines.append(
            f"| {name} | {m['mmac_per_row']:.1f} | {rows[0]:.3f} | {ratios} | "
            f"{m['draft_ms']:.3f} | {speed} |"
        )
    lines += ["", "Per shape (ms per call at 1..4 rows, the no-work call subtracted):", ""]
    lines += ["| in x out | 1 | 2 | 3 | 4 | 4 rows / 1 |", "|---|---:|---:|---:|---:|---:|"]
    for key, ms in sorted(result["shapes"].items(), key=lambda kv: int(kv[0].split("x")[0])):
        ratio = f"{ms[3] / ms[0]:.2f}" if ms[0] > 0 else "-"  # below the no-work call's noise
        lines.append(f"| {key} | " + " | ".join(f"{v:.4f}" for v in ms) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for name, m in result["models"].items():
        rows = m["linears_ms"]
        left.plot(ROWS, [r / rows[0] for r in rows], marker="o", label=name)
        right.bar(
            [f"{name[:3]}\nd{k}" for k in (1, 2, 3)],
            [m["speedup_linears"][str(k)] for k in (1, 2, 3)],
        )
    left.plot(ROWS, ROWS, linestyle=":", color="grey", label="rows x one row")
    left.set(xlabel="rows of x (verify of rows - 1 drafts)", ylabel="linears' cost / one row")
    left.legend()
    right.axhline(1.0, color="grey", linestyle=":")
    right.set(ylabel="speed-up the linears allow")
    threads = result["machine"]["threads"]
    fig.suptitle(f"edgemtp Q4_0 kernel, {result['machine']['cpu']}, threads: {threads}")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["embedded", "e2b"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="q4_0_rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if reason := kernels.unavailable():
        print(f"edgemtp's kernels do not build here: {reason}", file=sys.stderr)
        return 1
    pairs = {name: configs(name) for name in args.models}
    linears = {n: (target_linears(t), drafter_linears(d)) for n, (t, d) in pairs.items()}
    shapes = {timed_shape(s) for t, d in linears.values() for s in (*t, *d)}
    cost = time_shapes(shapes, args.threads, args.repeat)
    committed = committed_by_depth()
    models = {}
    for name, (target, drafter) in linears.items():
        rows, draft = model_costs(target, drafter, cost)
        models[name] = {
            "mmac_per_row": sum(n * s[0] * s[1] for s, n in target.items()) / 1e6,
            "linears_ms": rows,
            "draft_ms": draft,
            "speedup_linears": {
                str(k): committed[k] * rows[0] / (rows[k] + k * draft) for k in (1, 2, 3)
            },
        }
    result = {
        "command": command_line("q4_0_rows.py"),
        "date": datetime.date.today().isoformat(),
        "machine": machine(threads=args.threads),
        "repeat": args.repeat,
        "committed_by_depth": committed,
        "models": models,
        "shapes": {f"{s[0]}x{s[1]}": ms for s, ms in cost.items()},
    }
    write_results(RESULTS / args.out, result, report(result), lambda p: plot(result, p))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

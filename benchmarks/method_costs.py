"""Where an ExecuTorch bundle's decode time goes: each method's cost per call, and per op type.

    python benchmarks/method_costs.py --bundle DIR [--threads 1] [--repeat 7] [--calls 100]
        [--etdump] [--against OTHER_BUNDLE] [--positions 16,480,1800 [--every-bucket]]
        [--out benchmarks/results/NAME]

Calls every decode method (verify_K, draft_step, the draft chains draft_K; prefill_final and
its context buckets' with --prefill) with inputs built from the manifest's signatures
(positions past the prompt, so masks and ring writes are real), interleaved, `--repeat`
rounds of `--calls` calls: the median ms per call (each method of ExecuTorch's `portable_lib`
Module owns its cache, which no call here fills: its untouched pages are the zero page, so
attention reads cost what L1 costs;
`--positions` times the decode method over a cache the runtime's prefill wrote). `--etdump`
then loads the program again with ExecuTorch's event tracer and splits each method's time by
operator type (XNNPACK ops inside the delegates, portable kernels outside them, and the per-call
overhead: DELEGATE_CALL time not covered by the ops inside it).
`--against` times another bundle's program (e.g. exported by an earlier commit) interleaved with
this one: the ratio of a change measured side by side. Writes NAME.json and NAME.md.
`--positions` times the AR decode method at context positions instead: per position a session
prefills that many seeded random tokens (so the cache holds real keys and the kernel attends to
them), then the method the runtime picks there is called at the next position, `--repeat` rounds
of `--calls`, every position's session (and `--against`'s, the same positions) in each round;
`--every-bucket` adds the wider context buckets' methods at each position. The runtime's own
Python host overhead is not here: `benchmarks/runtime_backends.py` has it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from harness import machine, ms_per_call, write_results

POSITION = 100  # where decode calls write: past a prompt, inside the context


def method_inputs(signature: dict) -> tuple[torch.Tensor, ...]:
    out = []
    for spec in signature["inputs"]:
        shape = spec["shape"]
        if spec["dtype"] == "int64":
            out.append(torch.arange(POSITION, POSITION + shape[0]))
        else:
            out.append(torch.randn(*shape) * 0.1)
    return tuple(out)


def decode_methods(manifest: dict, prefill: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    names = [n for n in manifest["methods"] if n.startswith(("verify_", "draft_"))]
    if prefill:  # and per context bucket, where the bundle has them
        names += [n for n in manifest["methods"] if n.startswith("prefill_final")]
    return {n: method_inputs(manifest["methods"][n]) for n in sorted(names)}


def time_methods(
    ptes: dict[str, Path], calls: dict, repeat: int, n: int
) -> dict[str, dict[str, float]]:
    """Median ms per call of each method of each program (label -> .pte), all loaded in this
    process and interleaved: per round and method, the programs take turns (order alternating
    between rounds), so a slow minute of a shared machine hits them alike."""
    from executorch.extension.pybindings import portable_lib

    modules = {label: portable_lib._load_for_executorch(str(p)) for label, p in ptes.items()}
    samples: dict[tuple[str, str], list[float]] = {(lb, m): [] for lb in ptes for m in calls}
    for r in range(repeat):
        for name, inputs in calls.items():
            for label in list(modules)[:: -1 if r % 2 else 1]:
                call = partial(modules[label].run_method, name, inputs)
                samples[(label, name)].append(ms_per_call(call, n, warmup=5))
    return {lb: {m: statistics.median(samples[(lb, m)]) for m in calls} for lb in ptes}


def op_breakdown(pte: Path, name: str, inputs: tuple, n: int) -> dict[str, dict[str, float]]:
    """ms per call by operator type, from ETDump (one fresh load per method)."""
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    module = portable_lib._load_for_executorch(str(pte), enable_etdump=True)
    for _ in range(n):
        module.run_method(name, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "run.etdp"
        module.write_etdump_result_to_file(str(dump), str(Path(tmp) / "debug.bin"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(etdump_path=str(dump))
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        for event in block.events:
            if event.perf_data is None:
                continue
            key = re.sub(r" #\d+$", "", event.name)  # "GEMM #12" -> "GEMM": by op type
            totals[key][0] += len(event.perf_data.raw)
            totals[key][1] += sum(event.perf_data.raw)
    runs = totals["Method::execute"][0] or 1
    table = {k: {"count": c / runs, "ms": t / runs} for k, (c, t) in totals.items()}
    inside = sum(
        v["ms"]
        for k, v in table.items()
        if k not in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL")
        and not k.startswith("native_call_")
    )
    portable = sum(v["ms"] for k, v in table.items() if k.startswith("native_call_"))
    table["(xnnpack ops)"] = {"count": 0, "ms": inside}
    table["(portable kernels)"] = {"count": 0, "ms": portable}
    table["(delegate overhead)"] = {"count": 0, "ms": table["DELEGATE_CALL"]["ms"] - inside}
    return table


def time_positions(
    bundles: dict[str, Path],
    threads: int,
    positions: list[int],
    repeat: int,
    n: int,
    every_bucket: bool = False,
) -> list:
    """[(bundle's name, position, method, median ms per call)] of the AR method over a cache
    filled to each position by the runtime's own prefill: one session per bundle and position,
    all timed round by round, interleaved (the host's noise then falls on every one alike).
    `every_bucket`: also the AR methods of the larger context buckets and of the whole cache
    at each position (what a bucket's width costs, apart from the keys attended)."""
    from edgemtp.runtime.session import Session

    gen = torch.Generator().manual_seed(0)
    calls = {}
    for position in positions:
        prompt = torch.randint(3, 32_000, (position,), generator=gen).tolist()
        for name, bundle in bundles.items():
            session = Session.from_bundle(bundle, threads=threads, verify=False)
            backend = session.backend
            ids = [t % backend.vocab_size for t in prompt]
            session.generate(ids, 1, mtp=0, stop_ids=())
            shapes = backend.shapes
            methods = [shapes.verify_method(0, position + 1)[0]]
            if every_bucket:
                wider = [b for b in shapes.context_buckets if b > position + 1]
                methods += [shapes.verify_method(0, b)[0] for b in wider] + ["verify_0"]
            inputs = backend._padded([ids[-1]], position, 1)
            for method in dict.fromkeys(methods):
                call = partial(backend.runner.call, method, *inputs)
                for _ in range(5):  # warm-up
                    call()
                calls[name, position, method] = (call, session)
    samples: dict[tuple, list[float]] = {key: [] for key in calls}
    for r in range(repeat):
        for key, (call, _) in calls.items():
            samples[key].append(ms_per_call(call, n))
        print(f"round {r + 1}/{repeat}", file=sys.stderr)
    return [(*key, statistics.median(ms)) for key, ms in samples.items()]


def report(result: dict) -> str:
    lines = [
        f"# Method costs: {result['bundle']}",
        "",
        f"`{result['command']}`",
        "",
        f"{result['machine']['cpu']}; XNNPACK threads: {result['threads']}; medians of "
        f"{result['repeat']} {'' if 'positions' in result else 'interleaved '}rounds of "
        f"{result['calls']} calls.",
        "",
    ]
    if "positions" in result:
        lines += ["| bundle | position | method | ms per call | / the first position's |"]
        lines += ["|---|---:|---|---:|---:|"]
        first: dict[str, float] = {}
        for name, p, m, ms in result["positions"]:
            first.setdefault(name, ms)
            lines.append(f"| {name} | {p} | {m} | {ms:.3f} | {ms / first[name]:.2f} |")
        return "\n".join(lines) + "\n"
    against = result.get("against_ms_per_call")
    if against:
        lines += [
            f"Against `{result['against']}` (same methods, same process, interleaved).",
            "",
            "| method | ms per call | against | ratio |",
            "|---|---:|---:|---:|",
        ]
        for name, ms in result["ms_per_call"].items():
            lines.append(f"| {name} | {ms:.3f} | {against[name]:.3f} | {ms / against[name]:.3f} |")
    else:
        lines += ["| method | ms per call | / verify_0 |", "|---|---:|---:|"]
        base = result["ms_per_call"].get("verify_0")
        for name, ms in result["ms_per_call"].items():
            ratio = f"{ms / base:.2f}" if base else "-"
            lines.append(f"| {name} | {ms:.3f} | {ratio} |")
    for name, table in result.get("ops", {}).items():
        lines += ["", f"## {name} by op type (ETDump; tracing adds its own overhead)", ""]
        lines += ["| op | calls | ms |", "|---|---:|---:|"]
        ordered = sorted(table.items(), key=lambda kv: -kv[1]["ms"])
        for op, v in ordered[:16]:
            lines.append(f"| {op} | {v['count']:.0f} | {v['ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--prefill", action="store_true", help="also time prefill_final")
    parser.add_argument("--etdump", action="store_true", help="split each method by op type")
    parser.add_argument(
        "--against", type=Path, help="another bundle of the same shapes, timed interleaved"
    )
    parser.add_argument(
        "--positions", help="comma-separated context positions: time the AR method at each"
    )
    parser.add_argument(
        "--every-bucket",
        action="store_true",
        help="with --positions: also each wider context bucket's method at each position",
    )
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from executorch.extension.pybindings import portable_lib

    from edgemtp.runtime import kernels
    from edgemtp.runtime.runners.executorch import enable_xnnpack_weight_cache

    manifest = json.loads((args.bundle / "manifest.json").read_text())
    if manifest["backend"] != "executorch":
        sys.exit(f"{args.bundle}: a {manifest['backend']} bundle; this script times ExecuTorch")
    pte = args.bundle / manifest["program"]
    enable_xnnpack_weight_cache()
    kernels.load()  # a program exported with --kernels edgemtp calls them
    portable_lib._unsafe_reset_threadpool(args.threads)
    torch.manual_seed(0)
    result = {
        "bundle": str(args.bundle),
        "command": "python " + " ".join(sys.argv),
        "machine": machine(args.threads),
        "threads": args.threads,
        "repeat": args.repeat,
        "calls": args.calls,
    }
    if args.positions:
        positions = [int(p) for p in args.positions.split(",")]
        bundles = {"bundle": args.bundle}
        if args.against is not None:
            bundles["against"] = args.against
            result["against"] = str(args.against)
        result["positions"] = time_positions(
            bundles, args.threads, positions, args.repeat, args.calls, args.every_bucket
        )
        finish(result, args.out)
        return
    calls = decode_methods(manifest, args.prefill)
    print(f"timing {', '.join(calls)}", file=sys.stderr)
    ptes = {"bundle": pte}
    if args.against is not None:
        other = json.loads((args.against / "manifest.json").read_text())
        missing = sorted(set(calls) - set(other["methods"]))
        if missing:
            sys.exit(f"{args.against}: no {', '.join(missing)}; compare bundles of one shape")
        ptes["against"] = args.against / other["program"]
        result["against"] = str(args.against)
    timed = time_methods(ptes, calls, args.repeat, args.calls)
    result["ms_per_call"] = timed["bundle"]
    if args.against is not None:
        result["against_ms_per_call"] = timed["against"]
    if args.etdump:
        result["ops"] = {}
        for name, inputs in calls.items():
            print(f"tracing {name}", file=sys.stderr)
            result["ops"][name] = op_breakdown(pte, name, inputs, 30)
    finish(result, args.out)


def finish(result: dict, out: Path | None) -> None:
    text = report(result)
    print(text)
    if out:
        write_results(out.with_suffix(""), result, text)  # OUT's own suffix gives way, as ever


if __name__ == "__main__":
    main()

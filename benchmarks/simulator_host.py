"""The simulator against this host: `edgemtp bench` measurements beside its predictions.

    python benchmarks/simulator_host.py [--work /work/val] [--threads 1] [--repeat 5]
        [--peer PEER-90M-Q4_0.gguf | --full-e2b] [--only BUNDLE ...] [--predict-again]

Builds (once, under --work) two model sizes for two backends, and with --peer a third:

- demo-et, demo-onnx: the embedded pair (16 M target, trained; its own drafter), Q4_0,
  ExecuTorch XNNPACK and ONNX Runtime CPU, max context 512, depth 3, chunk 64;
- e2b-et, e2b-onnx: `synth --preset e2b --scale 0.25` with its assistant (random weights,
  262144-token vocabulary), Q4_0, max context 1024, depth 3, chunk 128;
- peer-et: PEER-90M (benchmarks/peers), target alone, from its Q4_0 GGUF as the peer table
  exports it (ExecuTorch, max context 4096, chunk 128);

or, with --full-e2b, only the full-size E2B shape (`synth --preset e2b` and its assistant,
random weights; ExecuTorch, Q4_0, max context 1024, depth 3, chunk 128: a 15-minute export)
into OUT/simulator_host_e2b_full.{json,md,png};

and for each bundle calibrates this host (`edgemtp devices calibrate --threads N`, into --work),
at once runs `edgemtp bench` on it with that profile: prefill (pp) and decode (tg) at depths
0-3, and calibrates again; each row is predicted from both profiles (their geometric mean).
The demo pair drafts with its own drafter; the random e2b drafter agrees with nothing, so its
MTP rows use `--acceptance-oracle 0.7` (the drafter still runs). The simulator is given the
acceptance each row measured. Writes OUT/simulator_host.{json,md,png} and keeps each bench's
report under --work.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from harness import EDGEMTP, REPO, RESULTS, command_line, pyplot, save_figure, write_results

MODELS = REPO / "checkpoints"
WITHIN = 0.25


def bundles(work: Path, peer: Path | None = None, full: bool = False) -> dict[str, dict[str, Any]]:
    if full:  # the full-size E2B shape alone: its export and bench are a check of their own
        return {
            "e2b-full-et": {
                "export": ["--model", str(work / "e2b"), "--drafter", str(work / "e2b-a"),
                           "--max-context", "1024", "--prefill-chunk", "128", "--backend",
                           "executorch", "--quant", "q4_0", "--draft-depth", "3"],
                "bench": ["--pp", "128", "--tg", "32", "--mtp", "0,2", "--acceptance-oracle",
                          "0.7"],
            }
        }  # fmt: skip
    demo = [
        "--model",
        str(MODELS / "embedded-target"),
        "--drafter",
        str(MODELS / "embedded-assistant"),
        "--max-context",
        "512",
        "--prefill-chunk",
        "64",
    ]
    e2b = ["--model", str(work / "e2b-s0.25"), "--drafter", str(work / "e2b-s0.25-a"),
           "--max-context", "1024", "--prefill-chunk", "128"]  # fmt: skip
    demo_bench = ["--pp", "128,448", "--tg", "64", "--mtp", "0,1,2,3"]
    e2b_bench = ["--pp", "128,512", "--tg", "64", "--mtp", "0,2", "--acceptance-oracle", "0.7"]
    found = {
        f"{size}-{backend}": {
            "export": [
                *args,
                "--backend",
                "executorch" if backend == "et" else "onnx",
                "--quant",
                "q4_0",
                "--draft-depth",
                "3",
            ],
            "bench": bench,
        }
        for size, args, bench in (("demo", demo, demo_bench), ("e2b", e2b, e2b_bench))
        for backend in ("et", "onnx")
    }
    if peer is not None:  # PEER-90M, target alone, as benchmarks/peers exports it
        found["peer-et"] = {
            "export": ["--model", str(peer), "--backend", "executorch", "--max-context", "4096",
                       "--prefill-chunk", "128", "--quant", "auto"],
            "bench": ["--pp", "128,512", "--tg", "64", "--mtp", "0"],
        }  # fmt: skip
    return found


def run(command: list[str], log: Path) -> None:
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    with log.open("a") as out:
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)


def build(
    work: Path, log: Path, peer: Path | None, full: bool = False, only: Sequence[str] = ()
) -> None:
    """The bundles (those named in `only`, or all) not yet under --work."""
    work.mkdir(parents=True, exist_ok=True)
    wanted = {n: spec for n, spec in bundles(work, peer, full).items() if not only or n in only}
    scale, name = ("1", "e2b") if full else ("0.25", "e2b-s0.25")
    if any(n.startswith("e2b") for n in wanted) and not (work / name / "config.json").is_file():
        for preset, out in (("e2b", name), ("e2b-assistant", f"{name}-a")):
            run([*EDGEMTP, "synth", "--preset", preset, "--scale", scale, "--out",
                 str(work / out)], log)  # fmt: skip
    for name, spec in wanted.items():
        if not (work / name / "manifest.json").is_file():
            run([*EDGEMTP, "export", *spec["export"], "--out", str(work / name)], log)


def profile_of(work: Path, name: str, threads: int, when: str = "") -> Path:
    """The host profile calibrated just before bundle `name`'s bench (`when="after"`: just
    after it)."""
    return work / f"host-{threads}-{name}{'-' + when if when else ''}.toml"


def measure(
    work: Path,
    threads: int,
    repeat: int,
    log: Path,
    peer: Path | None,
    only: list[str],
    full: bool = False,
) -> list[dict[str, Any]]:
    """Per bundle (those named in `only`, or all): calibrate, bench at once with that
    profile, calibrate again. This shared host's speed drifts by up to 2x within minutes; a
    profile measured minutes before a bench can miss it by that much, whatever the model. The
    two calibrations bracket the bench."""
    for name, spec in bundles(work, peer, full).items():
        if only and name not in only:
            continue
        shutil.rmtree(work / f"bench-{name}", ignore_errors=True)  # one result per bundle
        calibrate = [*EDGEMTP, "devices", "calibrate", "--threads", str(threads), "--out"]
        run([*calibrate, str(profile_of(work, name, threads))], log)
        out = work / f"bench-{name}"
        run([*EDGEMTP, "bench", "--bundle", str(work / name), *spec["bench"], "--threads",
             str(threads), "--repeat", str(repeat), "--device",
             str(profile_of(work, name, threads)), "--out", str(out)], log)  # fmt: skip
        run([*calibrate, str(profile_of(work, name, threads, "after"))], log)
    return repredict(work, threads, peer, full)


def repredict(
    work: Path, threads: int, peer: Path | None, full: bool = False
) -> list[dict[str, Any]]:
    """The benches under --work (a bundle not benched there is left out) predicted with the
    simulator as it is now, from the profile calibrated before each bench and, where there is
    one, the one calibrated after it: a row's prediction is the geometric mean of the two (the
    host's state during the bench lies between them, as far as two calibrations can tell)."""
    from edgemtp.devices.bench_prediction import predict_bench as predict
    from edgemtp.runtime.bench import BenchPlan

    docs = []
    for name in bundles(work, peer, full):
        if not (work / f"bench-{name}").is_dir():
            continue
        (result,) = (work / f"bench-{name}" / "results").glob("*.json")
        doc = json.loads(result.read_text())
        p = doc["plan"]
        plan = BenchPlan(tuple(p["pp"]), tuple(p["tg"]), tuple(p["depths"]), p["repeat"],
                         p["tg_prompt"], p["acceptance_oracle"], p["seed"])  # fmt: skip
        profiles = [profile_of(work, name, threads, w) for w in ("", "after")]
        predictions = [
            predict(work / name, str(f), "cpu", plan, doc["runs"]) for f in profiles if f.is_file()
        ]
        doc["predictions"] = predictions[0]
        doc["predictions_bracket"] = [pr["rows"] for pr in predictions]
        docs.append({"name": name, **doc})
    return docs


def table(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for doc in docs:
        brackets = [{(p["test"], p["depth"]): p["tok_s"] for p in rows_}
                    for rows_ in doc["predictions_bracket"]]  # fmt: skip
        for s in doc["summary"]:
            each = [b[(s["test"], s["depth"])] for b in brackets]
            predicted = math.prod(each) ** (1 / len(each))
            error = predicted / s["tok_s_median"] - 1
            rows.append({
                "bundle": doc["name"],
                "backend": doc["bundle"]["backend"],
                "test": s["test"],
                "depth": s["depth"],
                "oracle": s["acceptance_oracle"],
                "acceptance": s["acceptance_rate"],
                "measured_tok_s": s["tok_s_median"],
                "measured_stdev": s["tok_s_stdev"],
                "predicted_tok_s": predicted,
                "predicted_before_after": each,
                "error": error,
                "within": abs(error) <= WITHIN,
            })  # fmt: skip
    return rows


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    ok = sum(r["within"] for r in rows)
    lines = [
        "# The simulator against this host",
        "",
        f"`{result['command']}` ({result['date']}); {result['machine']}; "
        f"{result['threads']} thread(s), {result['repeat']} timed rounds per row (median).",
        "",
        f"{ok} of {len(rows)} rows within ±{WITHIN:.0%} (error = predicted / measured - 1).",
        "",
        f"Profiles: {result['profile'].lstrip('# ')} Each bench ran between two calibrations "
        "(`host-N-<bundle>.toml` before, `host-N-<bundle>-after.toml` after); a row's prediction "
        "is the geometric mean of the two profiles' (both in the last column). Benches:",
        "",
        *(f"- `{b}`" for b in result["benches"]),
        "",
        "| bundle | test | depth | acceptance | measured tok/s | predicted tok/s | error | ±25 % "
        "| before / after |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        if r["oracle"] is not None and r["depth"]:
            acc += f" (oracle {r['oracle']:g})"
        sd = f" ± {r['measured_stdev']:.1f}" if r["measured_stdev"] is not None else ""
        lines.append(
            f"| {r['bundle']} | {r['test']} | {r['depth']} | {acc} | "
            f"{r['measured_tok_s']:.1f}{sd} | {r['predicted_tok_s']:.1f} | "
            f"{100 * r['error']:+.0f}% | {'yes' if r['within'] else 'no'} | "
            f"{' / '.join(f'{v:.1f}' for v in r['predicted_before_after'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 6))
    for kind, marker in (("pp", "s"), ("tg", "o")):
        for backend, color in (("executorch", "tab:blue"), ("onnx", "tab:orange")):
            mine = [r for r in rows if r["test"].startswith(kind) and r["backend"] == backend]
            ax.scatter([r["measured_tok_s"] for r in mine], [r["predicted_tok_s"] for r in mine],
                       marker=marker, color=color, label=f"{backend} {kind}")  # fmt: skip
    values = [v for r in rows for v in (r["measured_tok_s"], r["predicted_tok_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    for f in (1 - WITHIN, 1 + WITHIN):
        ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured tok/s (edgemtp bench)")
    ax.set_ylabel("predicted tok/s (edgemtp simulate, host profile)")
    ax.set_title("Simulator vs this host (dotted: ±25 %)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/work/val"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--peer",
        type=Path,
        help="PEER-90M's Q4_0 GGUF (benchmarks/peers/run.py builds it): also its bundle",
    )
    parser.add_argument(
        "--full-e2b",
        action="store_true",
        help="the full-size E2B shape alone (random weights): OUT/simulator_host_e2b_full.*",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        help="build and measure these bundles alone (say, one whose bench the host's drift "
        "spoiled); the others' benches under --work stay and are reported",
    )
    parser.add_argument(
        "--predict-again", action="store_true", help="reuse the benches under --work, predict anew"
    )
    args = parser.parse_args()
    log = args.work / "simulator_host.log"
    args.work.mkdir(parents=True, exist_ok=True)
    full = args.full_e2b
    if args.predict_again:
        docs = repredict(args.work, args.threads, args.peer, full)
    else:
        build(args.work, log, args.peer, full, args.only)
        docs = measure(args.work, args.threads, args.repeat, log, args.peer, args.only, full)
    machine = docs[0]["machine"]
    result = {
        "command": command_line("simulator_host.py"),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{machine['cpu']}, {machine['cores']} cores",
        "threads": args.threads,
        "repeat": args.repeat,
        "rows": table(docs),
        "benches": [f"{d['command']} ({d['created']})" for d in docs],
        "profile": profile_of(args.work, docs[0]["name"], args.threads).read_text().splitlines()[0],
        "predictions": {d["name"]: d["predictions"] for d in docs},
    }
    text = report(result)
    name = "simulator_host_e2b_full" if full else "simulator_host"
    write_results(args.out / name, result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

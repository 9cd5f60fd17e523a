"""`edgemtp simulate` against the published Gemma 4 E2B speeds of BRIEF §8, AR (depth 0) only.

    python benchmarks/simulator_published.py [--out DIR]

The published figures are without MTP, so each row is the simulator's depth-0 prediction for the
full-size `e2b` preset (q4_0, max context 4096, prefill chunk 128), built exactly as
`edgemtp simulate --preset e2b` builds it (context buckets only for the cpu delegate), on the
shipped device profile, compared with:

- LiteRT-LM's published E2B figures: Galaxy S26 Ultra CPU prefill 557 / decode 47 tok/s, GPU
  3808 / 52; iPhone 17 Pro CPU 532 / 25; Raspberry Pi 5 CPU 133 / 8 (prompt 1024 / 256 generated
  tokens assumed, LiteRT-LM's benchmark convention);
- a Core ML port's "E2B at ~34 tok/s on iPhone 17 Pro" (decode; its compute unit is not stated,
  the profile's GPU delegate is assumed);
- ExecuTorch's example "Galaxy S25 decode ~6 tok/s", only if a Galaxy S25 profile exists.

Nothing is fitted: the profiles hold hardware specifications only, and the errors
(predicted / published - 1) are reported as they come, with the roofline terms behind each
prediction (memory, compute, dispatch) so the likely cause can be read off. Pure arithmetic, no
model is loaded. Writes OUT/simulator_published.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from harness import RESULTS, command_line, pyplot, save_figure, write_results

from edgemtp.devices.profiles import list_profiles, load_profile
from edgemtp.devices.simulator import (
    OPS_PER_LAYER,
    Model,
    Prediction,
    mean_acceptance,
    model_from_preset,
    simulate,
)
from edgemtp.model.cost import forward_work
from edgemtp.model.static import auto_context_buckets

PRESET, QUANT, MAX_CONTEXT, CHUNK = "e2b", "q4_0", 4096, 128
PROMPT, GEN = 1024, 256
DEPTHS = (0,)
ACCEPTANCE = (0.6, 0.9)  # `edgemtp simulate`'s default; no effect at depth 0

LITERT = "LiteRT-LM published E2B figures (BRIEF §8)"
LITERT_NOTE = (
    f"Prompt {PROMPT} / gen {GEN} assumed (LiteRT-LM's benchmark convention is prefill 1024 / "
    "decode 256 tokens; the brief gives no lengths)."
)
COREML_QUOTE = '"Core ML ports run E2B at ~34 tok/s on iPhone 17 Pro" (BRIEF §8)'
S25_QUOTE = (
    '"ExecuTorch has a Gemma 4 example (8da4w, ~4 GB PTE, Galaxy S25 decode ~6 tok/s)" (BRIEF §8)'
)

# (device profile, delegate or None: the profile's gpu-like one, quantity, figure, source, note)
PUBLISHED: tuple[tuple[str, str | None, str, float, str, str], ...] = (
    (
        "galaxy-s26-ultra",
        "cpu",
        "prefill",
        557,
        '"Galaxy S26 Ultra CPU prefill 557 / decode 47 tok/s (1.7 GB)": ' + LITERT,
        LITERT_NOTE,
    ),
    (
        "galaxy-s26-ultra",
        "cpu",
        "decode",
        47,
        '"Galaxy S26 Ultra CPU prefill 557 / decode 47 tok/s (1.7 GB)": ' + LITERT,
        LITERT_NOTE,
    ),
    ("galaxy-s26-ultra", "gpu", "prefill", 3808, '"GPU 3808 / 52": ' + LITERT, LITERT_NOTE),
    ("galaxy-s26-ultra", "gpu", "decode", 52, '"GPU 3808 / 52": ' + LITERT, LITERT_NOTE),
    (
        "iphone-17-pro",
        "cpu",
        "prefill",
        532,
        '"iPhone 17 Pro CPU 532 / 25": ' + LITERT,
        LITERT_NOTE,
    ),
    ("iphone-17-pro", "cpu", "decode", 25, '"iPhone 17 Pro CPU 532 / 25": ' + LITERT, LITERT_NOTE),
    (
        "raspberry-pi-5",
        "cpu",
        "prefill",
        133,
        '"Raspberry Pi 5 CPU 133 / 8": ' + LITERT,
        LITERT_NOTE,
    ),
    ("raspberry-pi-5", "cpu", "decode", 8, '"Raspberry Pi 5 CPU 133 / 8": ' + LITERT, LITERT_NOTE),
    (
        "iphone-17-pro",
        None,
        "decode",
        34,
        COREML_QUOTE,
        "The port's compute unit is not stated: the profile's GPU delegate ({delegate}) is an "
        f"assumption, as are q4_0 weights and prompt {PROMPT} / gen {GEN}.",
    ),
)
NOT_CHECKED: tuple[tuple[str, str, str, float, str, str], ...] = (
    ("galaxy-s25", "cpu", "decode", 6, S25_QUOTE, "ExecuTorch's Gemma 4 example, 8da4w"),
)
GPU_LIKE = ("gpu", "metal")


def build_model(delegate: str) -> Model:
    """The model `edgemtp simulate --preset e2b` builds (cli.run_simulate), for depth 0."""
    buckets = auto_context_buckets(MAX_CONTEXT) if delegate == "cpu" else ()
    return model_from_preset(PRESET, QUANT, MAX_CONTEXT, CHUNK, max(DEPTHS), buckets)


def breakdown(model: Model, pred: Prediction) -> dict[str, dict[str, Any]]:
    """Memory, compute, dispatch and host terms behind the simulator's prefill and depth-0
    decode (its own `Prediction.terms`), and the prefill FLOPs without pruning."""
    cfg = model.target
    unpruned = 0.0
    for start in range(0, PROMPT, model.chunk):
        rows = range(start, min(start + model.chunk, PROMPT))
        last = rows.stop == PROMPT
        every = forward_work(cfg, rows, len(rows), int(last), model.bits, model.cache_keys())
        unpruned += every.flops  # the KV-shared layers on every row (no pruning)
    out = {}
    for name, key, tokens in (("prefill", "prefill", PROMPT), ("decode", "verify_0", 1)):
        t = asdict(pred.terms[key])
        t["total_s"] = t.pop("seconds")
        t["roofline_s"] = t["total_s"] - t["dispatch_s"] - t["host_s"]  # free launches
        out[name] = {"tokens": tokens, **t}
    out["prefill"]["unpruned_flops"] = unpruned
    out["decode"].update(unpruned_flops=None, position=PROMPT + GEN // 2)
    return out


def likely_cause(row: dict[str, Any]) -> str:
    """One sentence on the likely cause of the error, read off the roofline terms."""
    t, a = row["terms"], row["assumptions"]
    published, error = row["published_tok_s"], row["error"]
    share = t["dispatch_s"] / t["total_s"]
    roofline = t["tokens"] / t["roofline_s"]
    per_token_gb = t["bytes"] / t["tokens"] / 1e9
    per_token_gflop = t["flops"] / t["tokens"] / 1e9
    if a["dispatch"].endswith("kernel"):
        launches = (
            f"{t['launches']} launches x {a['dispatch']}, from {OPS_PER_LAYER} operators per "
            "layer (what the PEER-90M ExecuTorch export dispatches)"
        )
    else:
        launches = f"{t['launches']} graph call(s) x {a['dispatch']}"
    if error < 0 and share >= 0.25:
        budget_ms = (t["tokens"] / published - t["roofline_s"]) * 1e3
        if budget_ms <= 0:
            tail = (
                "and even that is slower than published, so besides the launches the "
                f"{per_token_gb:.2f} GB read per token or the profile's "
                f"{a['memory_bandwidth_gbs']:.0f} GB/s sustained bandwidth is off"
            )
        elif abs(roofline / published - 1) <= 0.25:
            tail = "so the launch count or per-launch cost is the likely overestimate"
        else:
            tail = (
                f"so the published time leaves {budget_ms:.0f} ms for launches where the "
                f"simulator charges {t['dispatch_s'] * 1e3:.0f} ms: launches are overcounted, "
                "though not all of the gap"
            )
        return (
            f"Dispatch is {share:.0%} of the predicted time: {launches}; with free launches the "
            f"same roofline gives {fmt_rate(roofline)} tok/s ({roofline / published - 1:+.0%}), "
            f"{tail}."
        )
    if t["compute_s"] > t["memory_s"]:
        implied = published * per_token_gflop / 1e3
        pruning = ""
        if t["unpruned_flops"]:
            pruning = (
                " (and that count assumes edgemtp's pruned prefill; without pruning the KV-shared "
                f"layers it is {t['unpruned_flops'] / t['flops']:.1f}x the work)"
            )
        if error > 0:
            return (
                f"Compute-bound at the profile's peak {a['peak_tops']} {a['compute_dtype']} TOPS "
                "(every pipe busy every cycle, no kernel-efficiency factor): the published figure "
                f"implies {implied:.2f} TOPS on the simulator's {per_token_gflop:.2f} GFLOP per "
                f"token ({implied / a['peak_tops']:.0%} of that peak), so peak-rate compute is "
                f"the likely overestimate{pruning}."
            )
        return (
            f"Compute-bound at {a['peak_tops']} {a['compute_dtype']} TOPS and still slower than "
            f"published: the published figure implies {implied:.2f} TOPS, so the peak rate or "
            "the FLOPs counted per token are off."
        )
    implied = published * per_token_gb
    if error > 0:
        return (
            f"Memory-bound at the profile's sustained {a['memory_bandwidth_gbs']:.0f} GB/s for "
            f"{per_token_gb:.2f} GB read per token, dispatch {share:.0%} of the time: the "
            f"published figure implies {implied:.0f} GB/s for those bytes, so the runtime streams "
            "below the assumed bandwidth or pays costs the roofline leaves out."
        )
    return (
        f"Memory-bound: {per_token_gb:.2f} GB per token at the profile's sustained "
        f"{a['memory_bandwidth_gbs']:.0f} GB/s alone takes {t['memory_s'] * 1e3:.0f} ms, more "
        f"than the published {1e3 / published:.0f} ms per token (plus {t['dispatch_s'] * 1e3:.0f}"
        f" ms of dispatch): the published figure implies {implied:.1f} GB/s for those bytes, so "
        "the runtime reads fewer bytes per token than counted here or the bandwidth estimate is "
        "low (dispatch is overcounted too)."
    )


def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, skipped = [], []
    known = set(list_profiles())
    acceptance = mean_acceptance(*ACCEPTANCE, max(DEPTHS))
    for key, wanted, quantity, published, source, note in PUBLISHED:
        device = load_profile(key)
        delegate = wanted or next(d for d in GPU_LIKE if d in device.delegates)
        model = build_model(delegate)
        pred = simulate(model, device, delegate, DEPTHS, acceptance, PROMPT, GEN)
        parts = breakdown(model, pred)
        predicted = pred.prefill_tok_s if quantity == "prefill" else pred.decode_tok_s[0]
        row: dict[str, Any] = {
            "device": device.name,
            "profile": key,
            "delegate": delegate,
            "unit": device.delegates[delegate].unit,
            "quantity": quantity,
            "published_tok_s": published,
            "source": source,
            "predicted_tok_s": predicted,
            "error": predicted / published - 1,
            "prompt": PROMPT,
            "gen": GEN,
            "terms": parts[quantity],
            "peak_memory_mb": pred.peak_memory_mb,
            "assumptions": pred.assumptions,
        }
        cause = likely_cause(row)
        row["note"] = f"{note.format(delegate=delegate)} {cause}"
        if wanted is None:
            others = {
                d: simulate(build_model(d), device, d, DEPTHS, acceptance, PROMPT, GEN)
                for d in device.delegates
                if d != delegate
            }
            row["note"] += (
                " For reference, the other delegates give "
                + ", ".join(f"{d} {p.decode_tok_s[0]:.1f}" for d, p in others.items())
                + " tok/s."
            )
        rows.append(row)
        print(
            f"{key:<18} {delegate:<5} {quantity:<7} published {published:>6.0f}  "
            f"predicted {predicted:>7.1f}  error {row['error']:+.0%}",
            file=sys.stderr,
        )
    for key, delegate, quantity, published, source, what in NOT_CHECKED:
        if key in known:
            raise SystemExit(f"a '{key}' profile exists now: move its figure into PUBLISHED")
        skipped.append(
            {
                "device": key,
                "delegate": delegate,
                "quantity": quantity,
                "published_tok_s": published,
                "source": source,
                "note": f"not checked: no '{key}' device profile ({what}); shipped profiles: "
                + ", ".join(sorted(known)),
            }
        )
    return rows, skipped


def assumptions() -> dict[str, Any]:
    return {
        "model": f"preset {PRESET} (with its assistant, unused at depth 0), {QUANT} weights "
        "(stored as `model_from_preset` stores them)",
        "max_context": MAX_CONTEXT,
        "prefill_chunk": CHUNK,
        "context_buckets": "auto_context_buckets(4096) = "
        f"{list(auto_context_buckets(MAX_CONTEXT))} for the cpu delegate only, none otherwise "
        "(as `edgemtp simulate --preset` does)",
        "depths": list(DEPTHS),
        "max_draft": max(DEPTHS),
        "acceptance": f"mean {ACCEPTANCE[0]}, decay {ACCEPTANCE[1]} (the CLI default; no effect "
        "at depth 0)",
        "prompt_tokens": PROMPT,
        "gen_tokens": GEN,
        "lengths": "prompt 1024 / gen 256 for every row: LiteRT-LM's benchmark convention "
        "(prefill 1024, decode 256 tokens), assumed since the brief gives no lengths; decode is "
        f"priced at position {PROMPT + GEN // 2}, the middle of the generated span",
        "published_figures": "without MTP (AR), hence depth 0 only",
        "coreml_unit": "the Core ML port's compute unit is not stated; the profile's GPU "
        "delegate is assumed",
        "fitting": "none: no profile or simulator number was changed for these figures",
        "error": "predicted / published - 1",
    }


def aside(rows: list[dict[str, Any]]) -> str:
    """The one published non-speed figure (memory), compared but kept out of the table."""
    s26 = next(r for r in rows if r["profile"] == "galaxy-s26-ultra" and r["delegate"] == "cpu")
    return (
        'BRIEF §8 also gives "(1.7 GB)" for the Galaxy S26 Ultra CPU run (LiteRT-LM; what it '
        "measures is not stated); the simulator's peak-memory estimate for this model is "
        f"{s26['peak_memory_mb'] / 1024:.2f} GiB ({s26['assumptions']['peak_memory']}). Not a "
        "speed, so not a row."
    )


def fmt_rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def report(result: dict[str, Any]) -> str:
    lines = [
        "# `edgemtp simulate` against published Gemma 4 E2B speeds (AR, depth 0)",
        "",
        f"`{result['command']}` ({result['date']}; pure arithmetic, no model is run)",
        "",
        "Assumptions: " + "; ".join(f"{k}: {v}" for k, v in result["assumptions"].items()) + ".",
        "",
        "| device | delegate | quantity | published tok/s | source | predicted tok/s | error | "
        "note |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['device']} | {r['delegate']} | {r['quantity']} | "
            f"{fmt_rate(r['published_tok_s'])} | {r['source']} | "
            f"{fmt_rate(r['predicted_tok_s'])} | {r['error']:+.0%} | {r['note']} |"
        )
    for r in result["not_checked"]:
        lines.append(
            f"| {r['device']} | {r['delegate']} | {r['quantity']} | "
            f"{fmt_rate(r['published_tok_s'])} | {r['source']} | - | - | {r['note']} |"
        )
    lines += [
        "",
        result["aside"],
        "",
        "Roofline terms behind each prediction (ms for the whole prefill of "
        f"{PROMPT} tokens, or one decode step):",
        "",
        "| device | delegate | quantity | memory ms | compute ms | dispatch ms | launches | "
        "predicted ms | tok/s with free launches |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t = r["terms"]
        lines.append(
            f"| {r['device']} | {r['delegate']} | {r['quantity']} | {t['memory_s'] * 1e3:.1f} | "
            f"{t['compute_s'] * 1e3:.1f} | {t['dispatch_s'] * 1e3:.1f} | {t['launches']} | "
            f"{t['total_s'] * 1e3:.1f} | {fmt_rate(t['tokens'] / t['roofline_s'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 7))
    values = [v for r in rows for v in (r["published_tok_s"], r["predicted_tok_s"])]
    low, high = min(values) / 2, max(values) * 2
    ax.plot([low, high], [low, high], color="black", lw=1, label="predicted = published")
    for factor, style in ((2, "--"), (0.5, "--")):
        ax.plot([low, high], [low * factor, high * factor], color="grey", lw=0.8, ls=style)
    ax.plot([], [], color="grey", lw=0.8, ls="--", label="x2 / x0.5")
    markers = {"prefill": "s", "decode": "o"}
    for quantity, marker in markers.items():
        sel = [r for r in rows if r["quantity"] == quantity]
        ax.scatter(
            [r["published_tok_s"] for r in sel],
            [r["predicted_tok_s"] for r in sel],
            marker=marker,
            s=50,
            label=quantity,
            zorder=3,
        )
    for r in rows:
        right = r["published_tok_s"] > (low * high) ** 0.5 * 4  # near the right edge: label left
        ax.annotate(
            f"{r['profile']} {r['delegate']} {r['quantity']} ({r['error']:+.0%})",
            (r["published_tok_s"], r["predicted_tok_s"]),
            xytext=(-5, -12) if right else (5, 4),
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=7,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("published tok/s (BRIEF §8)")
    ax.set_ylabel("edgemtp simulate, depth 0 (tok/s)")
    ax.set_title(f"Simulator vs published Gemma 4 E2B speeds ({QUANT}, prompt {PROMPT}/gen {GEN})")
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows, skipped = run()
    result = {
        "command": command_line("simulator_published.py"),
        "date": datetime.date.today().isoformat(),
        "assumptions": assumptions(),
        "rows": rows,
        "not_checked": skipped,
        "aside": aside(rows),
    }
    text = report(result)
    write_results(args.out / "simulator_published", result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

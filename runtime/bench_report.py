"""Tables, plots and merged reports of `edgemtp bench` results (`runtime.bench`'s JSON), and
`edgemtp bench collect`: result files from an Android device (adb) or a folder.

Every result file is checked against `runtime/bench.schema.json` before it is read; the
report shows each file's rows with its machine, so host and device results sit in one table.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder
from edgemtp.runtime.bench import SCHEMA, SCHEMA_FILE, summarize

PHASES = ("target", "drafter", "embed", "sampling", "host")
ANDROID_RESULTS = "/sdcard/Android/data/dev.edgemtp.sample/files/bench"  # the Android app's


def check_result(doc: Any, where: str) -> dict[str, Any]:
    """One bench result, validated against the schema; one line naming what is wrong."""
    import jsonschema

    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise EdgeMTPError(
            f"{where}: not an edgemtp bench result (schema {found!r}, want {SCHEMA})"
        )
    schema = json.loads(SCHEMA_FILE.read_text())
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(doc)
    )
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise EdgeMTPError(f"{where}: bench result invalid at {path}: {error.message}")
    if "summary" not in doc:  # an app's result: the statistics are computed here, once
        doc["summary"] = summarize(doc["runs"])
    return doc


def read_result(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise EdgeMTPError(f"{path}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise EdgeMTPError(f"{path}: not JSON ({err}); is it a bench result?") from None
    return check_result(doc, str(path))


# --- the table -----------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kv_cache(kv: dict[str, Any] | None) -> str:
    return "-" if kv is None else f"{kv['dtype']} {kv['bytes'] / 2**20:.2f} MiB"


def table_rows(doc: dict[str, Any]) -> list[list[str]]:
    bundle, machine = doc["bundle"], doc["machine"]
    predicted = {(p["test"], p["depth"]): p for p in (doc.get("predictions") or {}).get("rows", [])}
    rows = []
    for row in doc["summary"]:
        pred = predicted.get((row["test"], row["depth"]))
        oracle = row.get("acceptance_oracle")
        mtp = str(row["depth"]) + (
            f" (oracle {oracle:g})" if oracle is not None and row["depth"] else ""
        )
        if row.get("depths_used"):  # auto: rounds per chosen depth
            mtp += " (" + ", ".join(f"{n}×d{k}" for k, n in row["depths_used"].items()) + ")"
        speed = _num(row["tok_s_median"])
        if row.get("tok_s_stdev") is not None:
            speed += f" ± {row['tok_s_stdev']:.1f}"
        valid = "-"
        if row["checked_runs"]:
            valid = f"{row['valid_runs']}/{row['checked_runs']}"
        rows.append(
            [
                f"{bundle['name']} ({bundle['quantization']})",
                f"{bundle['bytes'] / 2**20:.1f} MiB",
                _kv_cache(bundle.get("kv_cache")),
                f"{bundle['backend']}/{bundle['delegate']}",
                machine.get("device") or machine["cpu"],
                str(machine["threads"]),
                row["test"],
                mtp,
                speed + (f" ({row['failed']} failed)" if row["failed"] else ""),
                _num(row["vs_ar"], 2) + "x" if row["vs_ar"] and row["depth"] else "-",
                _num(row["committed_per_round"], 2),
                _num(
                    100 * row["acceptance_rate"] if row["acceptance_rate"] is not None else None, 0
                )
                + ("%" if row["acceptance_rate"] is not None else ""),
                valid,
                (_num(pred["tok_s"]) if pred else "-")
                + (f" (d{pred['best_depth']})" if pred and "best_depth" in pred else ""),
                f"{100 * pred['error']:+.0f}%" if pred and pred["error"] is not None else "-",
            ]
        )
    return rows


HEADER = [
    "model",
    "size",
    "kv cache",
    "backend",
    "machine",
    "threads",
    "test",
    "mtp",
    "t/s",
    "vs AR",
    "tok/round",
    "accept",
    "valid",
    "sim t/s",
    "sim err",
]


def text_table(docs: Sequence[dict[str, Any]]) -> str:
    """llama-bench's layout: a Markdown table that reads on a terminal too."""
    rows = [r for doc in docs for r in table_rows(doc)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    numeric = {1, 4, 7, 8, 9, 10, 11, 12, 13}

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(HEADER), rule, *(line(r) for r in rows)])


def markdown(docs: Sequence[dict[str, Any]], plots: Sequence[str]) -> str:
    parts = ["# edgemtp bench", "", text_table(docs), ""]
    parts.append(
        "t/s: prefill tokens/s for ppN, decode tokens/s = (n_out - 1) / (t_end - t_first) for "
        "tgN; median ± standard deviation of the timed runs (warm-up excluded). vs AR: the "
        "ratio of medians measured in the same run. tok/round: tokens committed per target "
        "forward. valid: MTP runs whose greedy tokens equal AR's on the same prompt. sim: the "
        "simulator's prediction for the same configuration and its error (predicted / measured "
        "- 1)."
    )
    for doc in docs:
        m, b, plan = doc["machine"], doc["bundle"], doc["plan"]
        libs = ", ".join(f"{k} {v}" for k, v in m.get("libraries", {}).items() if v)
        parts += [
            "",
            f"## {b['name']} on {m.get('device') or m['cpu']}",
            "",
            f"- command: `{doc['command']}` ({doc['created']})",
            f"- machine: {m.get('device') or m['cpu']}, {m.get('cores')} cores, "
            f"{m.get('memory_gib')} GiB, {m.get('os')}, {m.get('threads')} threads; {libs}",
            f"- bundle: {b['path']} (sha256 of its manifest {b['sha256'][:16]}…, "
            f"{b['backend']}/{b['delegate']}, {b['quantization']}, max context {b['max_context']})",
            f"- plan: pp {plan['pp']}, tg {plan['tg']} after a {plan['tg_prompt']}-token prompt, "
            f"depths {plan['depths']}, {plan['repeat']} rounds, {plan['sampling']}"
            + (
                f", acceptance oracle {plan['acceptance_oracle']}"
                if plan.get("acceptance_oracle") is not None
                else ""
            ),
        ]
        skipped = [r for r in doc["runs"] if "skipped" in r]
        for r in skipped:
            parts.append(f"- {r['test']}: skipped ({r['skipped']})")
        pred = doc.get("predictions")
        if pred:
            parts.append(
                f"- simulator: profile {pred['profile']} ({pred['device']}), delegate "
                f"{pred['delegate']}, profile threads {pred['profile_threads']}"
            )
        failed = [r for r in doc["runs"] if r.get("error")]
        for r in failed:
            parts.append(
                f"- failed run: {r['test']} depth {r['depth']} round {r['round']}: {r['error']}"
            )
    parts += ["", *(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(parts)


# --- plots -------------------------------------------------------------------------------------


def plot(docs: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """tok/s by depth (with the simulator's), acceptance by position, time per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    tg = [(doc, r) for doc in docs for r in doc["summary"] if r["test"].startswith("tg")]
    if not tg:
        return names
    label = lambda doc: f"{doc['bundle']['name']} · {doc['machine'].get('device') or 'host'}"  # noqa: E731

    fig, ax = plt.subplots(figsize=(7, 4))
    for doc in docs:
        rows = [r for r in doc["summary"] if r["test"].startswith("tg")]
        for test in dict.fromkeys(r["test"] for r in rows):
            mine = [r for r in rows if r["test"] == test and r["tok_s_median"]]
            for auto in [r for r in mine if r["depth"] == "auto"]:
                ax.axhline(
                    auto["tok_s_median"],
                    linestyle=":",
                    color="gray",
                    label=f"{label(doc)} {test} adaptive depth",
                )
            mine = [r for r in mine if r["depth"] != "auto"]
            depths = [r["depth"] for r in mine]
            lo = [r["tok_s_median"] - r["tok_s_min"] for r in mine]
            hi = [r["tok_s_max"] - r["tok_s_median"] for r in mine]
            ax.errorbar(
                depths,
                [r["tok_s_median"] for r in mine],
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=f"{label(doc)} {test} measured",
            )
            pred = {
                (p["test"], p["depth"]): p["tok_s"]
                for p in (doc.get("predictions") or {}).get("rows", [])
            }
            if any((test, d) in pred for d in depths):
                ax.plot(
                    depths,
                    [pred.get((test, d)) for d in depths],
                    "x--",
                    label=f"{label(doc)} {test} simulated",
                )
    ax.set_xlabel("draft depth (0 = AR)")
    ax.set_ylabel("decode tokens/s (median, min-max)")
    names.append(_finish(fig, ax, "Decode speed by draft depth", out / "tok_s_by_depth.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for doc, r in tg:
        rates = r["acceptance_by_position"]
        if rates:
            ax.plot(
                range(1, len(rates) + 1),
                [x if x is not None else float("nan") for x in rates],
                marker="o",
                label=f"{label(doc)} {r['test']} depth {r['depth']}",
            )
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafts before it were)")
    ax.set_ylim(0, 1.05)
    names.append(_finish(fig, ax, "Acceptance by position", out / "acceptance_by_position.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [
        f"{r['test']} d{r['depth']}" + (f"\n{label(doc)}" if len(docs) > 1 else "") for doc, r in tg
    ]
    bottom = [0.0] * len(tg)
    for phase in PHASES:
        values = [r["ms_per_token_by_phase"].get(phase, 0.0) for _, r in tg]
        ax.bar(range(len(tg)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(tg)), labels, fontsize=7)
    ax.set_ylabel("ms per committed token")
    names.append(_finish(fig, ax, "Where a decoded token's time goes", out / "time_by_phase.png"))
    return names


def _finish(fig: Any, ax: Any, title: str, path: Path) -> str:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# --- writing -----------------------------------------------------------------------------------


def write_report(docs: Sequence[dict[str, Any]], out: Path, keep: Sequence[Path] = ()) -> Path:
    """OUT/bench.md with its plots, and each result as OUT/results/NAME.json (`keep`: files
    already there under those names); written to a temporary folder, then put in place."""
    with staged_folder(Path(out)) as staging:
        (staging / "results").mkdir()
        for i, doc in enumerate(docs):
            name = keep[i].name if i < len(keep) else _result_name(doc)
            (staging / "results" / name).write_text(json.dumps(doc, indent=1) + "\n")
        plots = plot(docs, staging)
        (staging / "bench.md").write_text(markdown(docs, plots))
    return out


def _result_name(doc: dict[str, Any]) -> str:
    where = doc["machine"].get("device") or "host"
    stamp = doc["created"].replace(":", "").replace("-", "")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{doc['bundle']['name']}-{where}-{stamp}") + ".json"


# --- collect -------------------------------------------------------------------------------------


def collect(
    out: Path, folder: Path | None, adb: bool, serial: str | None, remote: str = ANDROID_RESULTS
) -> list[Path]:
    """Bench results from `folder` or from an Android device, merged with those already in
    OUT/results into OUT's report; returns the files the report now holds."""
    with tempfile.TemporaryDirectory() as pulled:
        if adb:
            folder = _adb_pull(remote, Path(pulled), serial)
        assert folder is not None
        if not Path(folder).is_dir():
            raise EdgeMTPError(f"{folder}: no such folder of bench results")
        found = sorted(Path(folder).rglob("*.json"))
        if not found:
            raise EdgeMTPError(f"{folder}: no bench result (*.json) in it")
        existing = sorted((Path(out) / "results").glob("*.json")) if Path(out).is_dir() else []
        docs = {p.name: read_result(p) for p in existing}
        for path in found:
            docs[path.name] = read_result(path)  # a newer copy of one file replaces it
        names = sorted(docs)
        write_report([docs[n] for n in names], out, [Path(n) for n in names])
    return [Path(out) / "results" / n for n in names]


def _adb_pull(remote: str, into: Path, serial: str | None) -> Path:
    from edgemtp.runtime.probes.adb import adb_problem

    if shutil.which("adb") is None:
        raise EdgeMTPError(
            "adb is not on PATH: install Android platform-tools, or copy the app's bench folder "
            f"({remote}) off the device and use --from DIR"
        )
    args = ["adb", *(["-s", serial] if serial else []), "pull", remote, str(into)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    problem = adb_problem(text, serial)
    if problem:
        raise EdgeMTPError(problem)
    if proc.returncode != 0:
        last = text.strip().splitlines()[-1] if text.strip() else f"exit {proc.returncode}"
        raise EdgeMTPError(f"adb pull {remote} failed: {last}")
    return into

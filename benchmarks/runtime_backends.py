"""AR decode speed and Python host overhead of each runtime backend, from one Q4_0 checkpoint.

The E2B preset, scaled to run on this host (`edgemtp synth --preset e2b --scale F` and
`--preset e2b-assistant --scale F`, default F = 0.25), is quantized once to Q4_0
(`edgemtp quantize --scheme q4_0`, target and assistant) and run three ways:

  - `reference`: `Session.from_checkpoints(Q, QD, max_context=1024, max_draft=3)`, PyTorch
    eager over the int4 weights dequantized to fp32 at load;
  - `executorch`: `edgemtp export --model Q --drafter QD --quant auto --backend executorch
    --delegate cpu --max-context 1024 --draft-depth 3` (XNNPACK, 8da4w: int8 dynamic
    activations, int4 weights), loaded by `Session.from_bundle`;
  - `onnx`: the same export with `--backend onnx` (MatMulNBits), on ONNX Runtime's CPU EP.

Checkpoints and bundles are cached in `--work` and reused when present (exports take minutes).

Method. Each (backend, repeat) runs in its own fresh process, so that its peak RSS (the kernel's
ru_maxrss: load included) is that backend's alone; the timing is measured inside that process.
Repeats are interleaved (reference, executorch, onnx, reference, ...) so that drift on this
shared machine hits every backend alike; every number reported is the median over `--repeats`.
One thread everywhere: `torch.set_num_threads(1)`, XNNPACK's thread pool 1, ORT intra-op 1.
In each process: load, one warm-up generate (`--warmup-tokens`, default 32: every method and
kernel the timed run uses, excluded), `session.reset()`, then the timed
`session.generate(prompt, 128, mtp=0, stop_ids=())`: greedy AR, a fixed 64-token prompt of
seeded random ids (`torch.randint(3, vocab, (64,), generator=manual_seed(0))`), no stop tokens,
so every run decodes exactly 127 rounds after prefill (tg128 after pp64).

From `Generation.metrics()`: decode tok/s ((n_out - 1) / (t_end - t_first)), prefill tok/s,
ITL p50/p95. From the per-phase trace of the decode rounds (`Generation.steps`): `embed` (host
table lookups), `target` (the compiled program's call, including the runtime bindings' own
input/output handling), `drafter` (0 in AR), `sampling` (argmax on the host) and `host` (the rest
of the Python loop). Python host overhead = (embed + sampling + host) / total. The ExecuTorch and
ONNX Runtime Python bindings' per-call overhead sits inside `target`, so it counts as program
time here. For ONNX Runtime the script also times `InferenceSession.run_with_iobinding` itself
(a wrapper set on the loaded runner's sessions, nothing in the runtime changed), which splits
`target` into ORT's run and the runner's Python around it (binding numpy inputs and outputs,
writing the new cache rows back). ExecuTorch's `Method.execute` is one pybind call that cannot
be split from Python.

Output validity: each backend's 128 tokens are compared with the reference's (same process
order, same prompt). ExecuTorch 8da4w quantizes activations to int8, so its tokens may differ;
a difference is recorded, never dropped.

Usage:
  python benchmarks/runtime_backends.py [--work DIR] [--scale 0.25] [--repeats 5]
                                        [--backends reference executorch onnx]
Writes benchmarks/results/runtime_backends.{json,md,png} (other scales: runtime_backends_s<F>.*);
`--report-only` redraws the Markdown and the PNG from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from harness import (
    EDGEMTP,
    REPO,
    RESULTS,
    folder_bytes,
    log,
    machine,
    pyplot,
    save_figure,
    write_report,
    write_results,
)

BACKENDS = ("reference", "executorch", "onnx")
PHASES = ("embed", "target", "drafter", "sampling", "host")
HOST_PHASES = ("embed", "sampling", "host")
GOAL = 0.10  # host overhead share of a decode step
MAX_CONTEXT = 1024
DRAFT_DEPTH = 3
LABELS = {
    "reference": "reference (PyTorch eager, int4 dequantized to fp32)",
    "executorch": "ExecuTorch 1.5.1 XNNPACK (8da4w)",
    "onnx": "ONNX Runtime CPU EP (MatMulNBits)",
}


# --- files --------------------------------------------------------------------------------------


class Paths:
    """Where the checkpoints and bundles of one scale live inside `--work`."""

    def __init__(self, work: Path, scale: float):
        s = f"s{scale:g}"
        self.work = work
        self.target = work / f"e2b-{s}"
        self.drafter = work / f"e2b-assistant-{s}"
        self.q_target = work / f"e2b-{s}-q4_0"
        self.q_drafter = work / f"e2b-assistant-{s}-q4_0"
        self.logs = work / "logs"

    def bundle(self, backend: str) -> Path:
        return self.work / f"bundle-{backend}"

    def logits(self, backend: str) -> Path:
        return self.work / f"prefill-logits-{backend}.pt"


def run_step(name: str, cmd: list[str], done: Path, paths: Paths) -> dict[str, Any]:
    """Run one preparation command unless `done` exists; its record (command, wall time, peak RSS
    from os.wait4) is kept in logs/<name>.json and reused with the output."""
    paths.logs.mkdir(parents=True, exist_ok=True)
    record_path = paths.logs / f"{name}.json"
    shown = " ".join(["edgemtp", *map(shlex.quote, cmd[len(EDGEMTP) :])])
    if done.exists():
        if record_path.exists():
            record = json.loads(record_path.read_text())
            record["cached"] = True
            return record
        return {"command": shown, "cached": True, "wall_s": None, "peak_rss_mb": None}
    log(f"{name}: {shown}")
    t0 = time.perf_counter()
    with open(paths.logs / f"{name}.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=paths.work)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        tail = (paths.logs / f"{name}.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{name} failed (exit {rc}):\n" + "\n".join(tail))
    record = {
        "command": shown,
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
        "date": datetime.date.today().isoformat(),
    }
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return {**record, "cached": False}


def prepare(paths: Paths, scale: float, backends: list[str]) -> dict[str, Any]:
    """Synthesize, quantize and export what is missing; returns each step's record."""
    steps: dict[str, Any] = {}
    for name, preset, out in (
        ("synth-target", "e2b", paths.target),
        ("synth-drafter", "e2b-assistant", paths.drafter),
    ):
        cmd = [*EDGEMTP, "synth", "--preset", preset, "--scale", f"{scale:g}", "--out", str(out)]
        steps[name] = run_step(name, cmd, out / "config.json", paths)
    for name, src, out in (
        ("quantize-target", paths.target, paths.q_target),
        ("quantize-drafter", paths.drafter, paths.q_drafter),
    ):
        cmd = [*EDGEMTP, "quantize", "--model", str(src), "--scheme", "q4_0", "--out", str(out)]
        steps[name] = run_step(name, cmd, out / "config.json", paths)
    for backend in backends:
        if backend == "reference":
            continue
        out = paths.bundle(backend)
        cmd = [*EDGEMTP, "export", "--model", str(paths.q_target), "--drafter"]
        cmd += [str(paths.q_drafter), "--quant", "auto", "--backend", backend]
        cmd += ["--delegate", "cpu", "--max-context", str(MAX_CONTEXT)]
        cmd += ["--draft-depth", str(DRAFT_DEPTH), "--out", str(out)]
        if out.exists() and not (out / "manifest.json").exists():
            cmd.append("--force")  # an export that did not finish
        name = f"export-{backend}"
        steps[name] = run_step(name, cmd, out / "manifest.json", paths)
        steps[name]["bundle_mib"] = round(folder_bytes(out) / 2**20, 1)
    return steps


# --- one measured run (child process) -----------------------------------------------------------


class _TimedSession:
    """Stands in for an ORT InferenceSession: times `run_with_iobinding`, passes the rest on."""

    def __init__(self, session: Any):
        self.session = session
        self.seconds = 0.0

    def run_with_iobinding(self, binding: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.session.run_with_iobinding(binding, *args)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def child(
    backend: str, paths: Paths, prompt_len: int, tokens: int, warmup: int, threads: int
) -> dict:
    import torch

    torch.set_num_threads(threads)
    from edgemtp.runtime.probes import current_rss_mb, peak_rss_mb
    from edgemtp.runtime.session import Session

    t0 = time.perf_counter()
    if backend == "reference":
        session = Session.from_checkpoints(
            paths.q_target, paths.q_drafter, max_context=MAX_CONTEXT, max_draft=DRAFT_DEPTH
        )
    else:
        session = Session.from_bundle(paths.bundle(backend), threads=threads, verify=False)
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_mb()
    timers: dict[str, _TimedSession] = {}
    if backend == "onnx":
        for name, method in session.backend.runner.methods.items():  # type: ignore[attr-defined]
            method.session = timers[name] = _TimedSession(method.session)
    vocab = session.backend.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    with torch.no_grad():
        t0 = time.perf_counter()
        warm = session.generate(prompt, warmup, mtp=0, stop_ids=())
        warm_s = time.perf_counter() - t0
        session.reset()  # the timed run prefills the whole prompt again
        for timer in timers.values():
            timer.seconds = 0.0
        calls_before = dict(getattr(session.backend, "calls", {}))
        result = session.generate(prompt, tokens, mtp=0, stop_ids=())
        # The prompt's last-row logits, for comparing the backends' numerics (after the timing).
        session.reset()
        _, logits = session.backend.prefill(prompt, 0)
        session.reset()
        torch.save(logits.float().flatten().clone(), paths.logits(backend))
    metrics = result.metrics()
    decode = [s for s in result.steps if s.kind == "decode"]
    assert all(s.rows == 1 for s in decode), "mtp=0 verifies one row per round"
    total = sum(s.seconds["total"] for s in decode)
    by_phase = {p: sum(s.seconds.get(p, 0.0) for s in decode) for p in PHASES}
    run: dict[str, Any] = {
        "backend": backend,
        "info": session.info,
        "threads": threads,
        "load_s": load_s,
        "warmup_s": warm_s,
        "warmup_tokens_equal": warm.tokens == result.tokens[: len(warm.tokens)],
        "rss_after_load_mb": rss_loaded,
        "rss_after_generate_mb": current_rss_mb(),
        "peak_rss_mb": peak_rss_mb(),
        "metrics": metrics,
        "decode_rounds": len(decode),
        "decode_seconds": total,
        "host_share": sum(by_phase[p] for p in HOST_PHASES) / total,
        "host_share_median_step": statistics.median(
            sum(s.seconds.get(p, 0.0) for p in HOST_PHASES) / s.seconds["total"] for s in decode
        ),
        "ms_per_step_by_phase": {p: 1000 * v / len(decode) for p, v in by_phase.items()},
        "steps": [
            {k: round(v, 7) for k, v in s.seconds.items()} | {"kind": s.kind, "rows": s.rows}
            for s in result.steps
        ],
        "tokens": result.tokens,
        "prompt": prompt,
        "stop_reason": result.stop_reason,
    }
    if timers:
        calls = {
            m: n - calls_before.get(m, 0)
            for m, n in session.backend.calls.items()  # type: ignore[attr-defined]
        }
        verify_s = sum(t.seconds for m, t in timers.items() if m.startswith("verify"))
        run["onnx"] = {
            "run_with_iobinding_s": {m: t.seconds for m, t in timers.items()},
            "calls": calls,
            "decode_ort_run_s": verify_s,
            "decode_runner_python_s": by_phase["target"] - verify_s,
        }
    return run


def run_child(backend: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", backend, "--work", str(args.work)]
    cmd += ["--scale", f"{args.scale:g}", "--prompt", str(args.prompt)]
    cmd += ["--tokens", str(args.tokens), "--warmup-tokens", str(args.warmup_tokens)]
    cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{backend} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    run["process_wall_s"] = wall
    return run


# --- summary, report, plot ----------------------------------------------------------------------


def med(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_steps(run: dict) -> list[dict]:
    return [s for s in run["steps"] if s["kind"] == "decode"]


def compare_logits(paths: Paths, backends: list[str]) -> dict[str, Any]:
    """Each backend's prefill logits (last prompt row) against the reference's."""
    import torch

    if "reference" not in backends:
        return {}
    ref = torch.load(paths.logits("reference"))
    out = {}
    for b in backends:
        got = torch.load(paths.logits(b))
        out[b] = {
            "cosine": float(torch.nn.functional.cosine_similarity(got, ref, dim=0)),
            "max_abs_error_over_max_abs": float((got - ref).abs().max() / ref.abs().max()),
            "argmax_equal": int(got.argmax()) == int(ref.argmax()),
            "reference_top1_rank": int((got > got[ref.argmax()]).sum()),
            "reference_top1_top2_margin": float(ref.topk(2).values.diff().abs()),
            "reference_logit_std": float(ref.std()),
        }
    return out


def summarize(runs: list[dict], backends: list[str]) -> dict[str, Any]:
    ref_tokens = next((r["tokens"] for r in runs if r["backend"] == "reference"), None)
    out: dict[str, Any] = {}
    for b in backends:
        rs = [r for r in runs if r["backend"] == b]
        m = [r["metrics"] for r in rs]
        tok_s = [x["decode_tok_s"] for x in m]
        s: dict[str, Any] = {
            "repeats": len(rs),
            "decode_tok_s": med(tok_s),
            "decode_tok_s_min": min(tok_s),
            "decode_tok_s_max": max(tok_s),
            "decode_tok_s_all": tok_s,
            "prefill_tok_s": med([x["prefill_tok_s"] for x in m]),
            "ttft_ms": med([1000 * x["ttft_s"] for x in m]),
            "itl_p50_ms": med([x["itl_p50_ms"] for x in m]),
            "itl_p95_ms": med([x["itl_p95_ms"] for x in m]),
            "host_share": med([r["host_share"] for r in rs]),
            "host_share_all": [r["host_share"] for r in rs],
            "host_share_median_step": med([r["host_share_median_step"] for r in rs]),
            "ms_per_step": med([1000 * r["decode_seconds"] / r["decode_rounds"] for r in rs]),
            "ms_per_step_by_phase": {
                p: med([r["ms_per_step_by_phase"][p] for r in rs]) for p in PHASES
            },
            "bytes_moved_per_step": med([x["bytes_moved_per_step"] for x in m]),
            "peak_rss_mb": med([r["peak_rss_mb"] for r in rs]),
            "rss_after_load_mb": med([r["rss_after_load_mb"] for r in rs]),
            "load_s": med([r["load_s"] for r in rs]),
            "step_ms_fastest": med([1000 * min(x["total"] for x in decode_steps(r)) for r in rs]),
            "step_ms_median": med(
                [1000 * statistics.median(x["total"] for x in decode_steps(r)) for r in rs]
            ),
            "deterministic": all(r["tokens"] == rs[0]["tokens"] for r in rs),
            "tokens_equal_reference": (
                None if ref_tokens is None else all(r["tokens"] == ref_tokens for r in rs)
            ),
            "first_divergence_from_reference": (
                None if ref_tokens is None else first_divergence(rs[0]["tokens"], ref_tokens)
            ),
        }
        if all("onnx" in r for r in rs):
            n = [r["decode_rounds"] for r in rs]
            s["onnx_ort_run_ms_per_step"] = med(
                [1000 * r["onnx"]["decode_ort_run_s"] / k for r, k in zip(rs, n, strict=True)]
            )
            s["onnx_runner_python_ms_per_step"] = med(
                [1000 * r["onnx"]["decode_runner_python_s"] / k for r, k in zip(rs, n, strict=True)]
            )
        out[b] = s
    return out


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(data: dict[str, Any]) -> str:
    mc, summary, shape = data["machine"], data["summary"], data["shape"]
    a = data["args"]
    lines = [
        f"# Runtime backends: AR decode speed and Python host overhead (E2B preset, scale "
        f"{a['scale']:g}, Q4_0)",
        "",
        f"Run {data['date']} on {mc['cpu']}, {mc['cores']} cores, {mc['memory_gib']} GiB RAM "
        f"({mc['available_gib_at_start']} GiB available at the start, load average "
        f"{mc['loadavg_at_start'][0]:.2f} at the start); {mc['os']}; Python {mc['python']}, "
        f"torch {mc['torch']}, executorch {mc['executorch']}, onnxruntime {mc['onnxruntime']}. "
        f"{mc['threads']} thread per backend.",
        f"Model: `synth --preset e2b --scale {a['scale']:g}` (hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers of which {shape['num_kv_shared_layers']} KV-shared, "
        f"vocabulary {shape['vocab_size']}, random weights) + `--preset e2b-assistant`, quantized "
        "once to Q4_0 (group 32; token table q4_0, per-layer table int8 per row); all three "
        "backends run these int4 weights. Max context 1024, draft depth 3 (the drafter is loaded "
        "but unused: `mtp=0`).",
        f"Workload: prompt {a['prompt']} fixed random ids (seed 0), {a['tokens']} tokens greedy "
        f"AR (tg{a['tokens']} after pp{a['prompt']}), no stop tokens. Medians of {a['repeats']} "
        "repeats; each (backend, repeat) is a fresh process with one excluded warm-up generate "
        f"({a['warmup_tokens']} tokens, same prompt); backends interleaved within each repeat.",
        "",
        "| backend | decode tok/s (min–max) | prefill tok/s | ITL p50 ms | ITL p95 ms "
        "| ms / decode step | host overhead | peak RSS MiB | load s | tokens = reference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, s in summary.items():
        if s["tokens_equal_reference"] is None:
            same = "-"
        elif s["tokens_equal_reference"]:
            same = f"yes ({len(data['runs'][0]['tokens'])}/{len(data['runs'][0]['tokens'])})"
        else:
            same = f"no (first differs at token {s['first_divergence_from_reference']})"
        if not s["deterministic"]:
            same += "; differs between repeats"
        share = s["host_share"]
        flag = "" if share < GOAL else " ⚠"
        lines.append(
            f"| {LABELS[b]} | **{fmt(s['decode_tok_s'])}** ({fmt(s['decode_tok_s_min'])}–"
            f"{fmt(s['decode_tok_s_max'])}) | {fmt(s['prefill_tok_s'], 0)} "
            f"| {fmt(s['itl_p50_ms'], 2)} | {fmt(s['itl_p95_ms'], 2)} | {fmt(s['ms_per_step'], 2)} "
            f"| **{100 * share:.1f} %**{flag} | {fmt(s['peak_rss_mb'], 0)} | {fmt(s['load_s'], 1)} "
            f"| {same} |"
        )
    lines += [
        "",
        "Time per decode step by phase (ms, medians over repeats; host overhead = embed + "
        "sampling + host, goal < 10 % of the step):",
        "",
        "| backend | embed | target (program call) | drafter | sampling | host (Python loop) "
        "| total | host overhead | host share of the median step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b, s in summary.items():
        p = s["ms_per_step_by_phase"]
        lines.append(
            f"| {b} | {p['embed']:.3f} | {p['target']:.3f} | {p['drafter']:.3f} "
            f"| {p['sampling']:.3f} | {p['host']:.3f} | {s['ms_per_step']:.3f} "
            f"| {100 * s['host_share']:.1f} % | {100 * s['host_share_median_step']:.1f} % |"
        )
    lines += ["", *data["notes"], "", "## Commands", "", "```bash"]
    for name, step in data["prepare"].items():
        when = "cached" if step.get("cached") else "ran"
        wall = f"{step['wall_s']:.0f} s" if step.get("wall_s") is not None else "time not recorded"
        rss = f", peak RSS {step['peak_rss_mb']} MiB" if step.get("peak_rss_mb") else ""
        note = f"; {step['note']}" if step.get("note") else ""
        lines.append(f"# {name} ({when}; {wall}{rss}{note})")
        lines.append(step["command"])
    lines += [
        "# the benchmark (wall " + f"{data['wall_s']:.0f} s)",
        data["command"],
        "```",
        "",
        "Raw per-run numbers (every step's phase times, tokens, RSS): `runtime_backends.json`.",
    ]
    return "\n".join(lines) + "\n"


def notes(summary: dict[str, Any], logits: dict[str, Any]) -> list[str]:
    out = [
        "- `target` is the wall time of `runner.call` (ExecuTorch `Method.execute`, ORT "
        "`run_with_iobinding` plus the runner's numpy binding and cache write-back) or, for the "
        "reference, the eager model's forward and LM head. The Python bindings' own per-call "
        "overhead (argument conversion, output wrapping) is inside it and counted as program "
        "time; an empty-call overhead cannot be measured from Python without a trivial method "
        "in the program, so it is not separated out.",
    ]
    o = summary.get("onnx", {})
    if o.get("onnx_ort_run_ms_per_step") is not None:
        run, py = o["onnx_ort_run_ms_per_step"], o["onnx_runner_python_ms_per_step"]
        total = o["ms_per_step"]
        out.append(
            f"- ONNX split of `target`: ORT's `run_with_iobinding` {run:.3f} ms per step, the "
            f"runner's Python around it {py:.3f} ms ({100 * py / total:.1f} % of the step: "
            "binding fresh numpy inputs/outputs, writing the new cache rows back on the host; "
            f"{o['bytes_moved_per_step'] / 1024:.0f} KiB moved per step). Counted with the host, "
            f"ONNX's overhead would be {100 * (o['host_share'] + py / total):.1f} %."
        )
    spread = ", ".join(
        f"{b} {s['decode_tok_s_min']:.1f}–{s['decode_tok_s_max']:.1f} tok/s (fastest step "
        f"{s['step_ms_fastest']:.1f} ms, median step {s['step_ms_median']:.1f} ms)"
        for b, s in summary.items()
    )
    out.append(
        f"- Run-to-run spread on this shared host: {spread}. The fastest step of a run is the "
        "backend's pace undisturbed; a wide range with a steady fastest step means another "
        "process held the memory bus or the second core during that run, not a slower backend."
    )
    for b, c in logits.items():
        if b == "reference":
            continue
        out.append(
            f"- {b} prefill logits (last prompt row) vs the reference's: cosine "
            f"{c['cosine']:.4f}, max |error| {100 * c['max_abs_error_over_max_abs']:.1f} % of "
            f"the largest logit; argmax {'equal' if c['argmax_equal'] else 'different'} (the "
            f"reference's top-1 is rank {c['reference_top1_rank']} here; its top-1/top-2 "
            f"margin {c['reference_top1_top2_margin']:.3f}, logit std "
            f"{c['reference_logit_std']:.3f})."
        )
    if "executorch" in logits and not summary["executorch"]["tokens_equal_reference"]:
        out.append(
            "- ExecuTorch's tokens differ from the reference's by design: 8da4w quantizes every "
            "linear's input to int8 per token, and this random-weight model is ill-conditioned "
            "with near-flat logits (tests/test_export_executorch.py measures int8 activations "
            "alone moving a random model's logits by 20-45 % of their range), so greedy picks "
            "diverge from the first token."
            + (
                " ONNX Runtime's MatMulNBits keeps fp32 activations on the same int4 weights and "
                "reproduces the reference's tokens."
                if summary.get("onnx", {}).get("tokens_equal_reference")
                else ""
            )
        )
    over = [b for b, s in summary.items() if s["host_share"] >= GOAL]
    for b in over:
        p = summary[b]["ms_per_step_by_phase"]
        worst = max(HOST_PHASES, key=lambda k: p[k])
        out.append(
            f"- {b}: host overhead {100 * summary[b]['host_share']:.1f} % is above the 10 % goal; "
            f"the largest host phase is `{worst}` ({p[worst]:.3f} ms per step)."
        )
    if not over:
        out.append("- Every backend's host overhead is under the 10 % goal.")
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    summary = data["summary"]
    names = list(summary)
    colors = {"reference": "tab:gray", "executorch": "tab:blue", "onnx": "tab:orange"}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.4), width_ratios=[1, 1, 1])
    for i, b in enumerate(names):
        s = summary[b]
        ax1.bar(i, s["decode_tok_s"], color=colors.get(b, "tab:green"))
        ax1.plot([i] * len(s["decode_tok_s_all"]), s["decode_tok_s_all"], "k.", ms=4)
        top = max(s["decode_tok_s_all"])
        ax1.text(i, top, f"{s['decode_tok_s']:.1f}", ha="center", va="bottom", weight="bold")
    ax1.set_xticks(range(len(names)), names)
    a = data["args"]
    ax1.set_ylabel(f"decode tok/s (tg{a['tokens']}, AR, {a['threads']} thread)")
    ax1.set_title(f"decode speed: median of {data['args']['repeats']} (dots: each run)")
    ax1.set_ylim(0, ax1.get_ylim()[1] * 1.12)
    phase_colors = {
        "embed": "tab:purple",
        "target": "tab:blue",
        "drafter": "tab:cyan",
        "sampling": "tab:red",
        "host": "tab:olive",
    }
    bottom = [0.0] * len(names)
    for p in PHASES:
        values = [summary[b]["ms_per_step_by_phase"][p] for b in names]
        if not any(values):
            continue
        ax2.bar(range(len(names)), values, bottom=bottom, label=p, color=phase_colors[p])
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    for i, b in enumerate(names):
        ax2.text(
            i,
            bottom[i],
            f"host {100 * summary[b]['host_share']:.1f} %",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_xticks(range(len(names)), names)
    ax2.set_ylabel("ms per decode step (median)")
    ax2.set_title("where a decode step's time goes")
    ax2.set_ylim(0, max(bottom) * 1.15)
    ax2.legend(fontsize=8)
    bottom = [0.0] * len(names)
    for p in HOST_PHASES:
        values = [
            100 * summary[b]["ms_per_step_by_phase"][p] / summary[b]["ms_per_step"] for b in names
        ]
        ax3.bar(range(len(names)), values, bottom=bottom, label=p, color=phase_colors[p])
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    if "onnx" in names and summary["onnx"].get("onnx_runner_python_ms_per_step") is not None:
        i = names.index("onnx")
        o = summary["onnx"]
        extra = 100 * o["onnx_runner_python_ms_per_step"] / o["ms_per_step"]
        ax3.bar(i, extra, bottom=bottom[i], color="none", edgecolor="k", hatch="//", lw=0.5)
        ax3.text(
            i,
            bottom[i] + extra,
            "+ ORT runner's\nPython (in target)",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax3.axhline(100 * GOAL, color="red", ls="--", lw=1)
    ax3.text(-0.45, 100 * GOAL, "goal 10 %", color="red", fontsize=8, va="bottom")
    ax3.set_xticks(range(len(names)), names)
    ax3.set_ylabel("% of a decode step (median ms per step)")
    ax3.set_title("Python host overhead")
    ax3.set_ylim(0, max(100 * GOAL, *bottom) * 1.4)
    ax3.legend(fontsize=8, loc="upper right")
    fig.suptitle(
        f"E2B preset scale {data['args']['scale']:g}, Q4_0, pp{data['args']['prompt']} + "
        f"tg{data['args']['tokens']}, {data['machine']['cpu']}",
        fontsize=9,
    )
    save_figure(fig, path, dpi=120)


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", type=Path, help="cache folder (default /work/e2b-bench/runtime-sF)")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=32, help="the excluded warm-up's length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--prepare-only", action="store_true", help="build what is missing, stop")
    ap.add_argument("--report-only", action="store_true", help="redraw md and png from the JSON")
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work = (args.work or Path(f"/work/e2b-bench/runtime-s{args.scale:g}")).resolve()
    paths = Paths(args.work, args.scale)
    if args.child:
        run = child(args.child, paths, args.prompt, args.tokens, args.warmup_tokens, args.threads)
        print(json.dumps(run))
        return 0

    stem = "runtime_backends" if args.scale == 0.25 else f"runtime_backends_s{args.scale:g}"
    if args.report_only:
        data = json.loads((RESULTS / f"{stem}.json").read_text())
        write_report(RESULTS / stem, report(data), partial(plot, data))
        return 0
    t_start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    mc = machine(args.threads)
    steps = prepare(paths, args.scale, args.backends)
    if args.prepare_only:
        print(json.dumps(steps, indent=1))
        return 0
    runs: list[dict] = []
    for r in range(args.repeats):
        for b in args.backends:
            run = run_child(b, args)
            run["repeat"] = r
            runs.append(run)
            m = run["metrics"]
            log(
                f"repeat {r + 1}/{args.repeats} {b}: decode {m['decode_tok_s']:.2f} tok/s, "
                f"prefill {m['prefill_tok_s']:.0f} tok/s, host {100 * run['host_share']:.1f} %, "
                f"peak RSS {run['peak_rss_mb']:.0f} MiB ({run['process_wall_s']:.0f} s)"
            )
    summary = summarize(runs, args.backends)
    cfg = json.loads((paths.q_target / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_kv_shared_layers", "vocab_size")
    command = f"python benchmarks/runtime_backends.py --work {args.work} --scale {args.scale:g}"
    command += f" --repeats {args.repeats} --prompt {args.prompt} --tokens {args.tokens}"
    command += f" --warmup-tokens {args.warmup_tokens}"
    command += f" --threads {args.threads} --backends {' '.join(args.backends)}"
    data: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "args": {k: v for k, v in vars(args).items() if k != "child"} | {"work": str(args.work)},
        "machine": mc,
        "shape": {k: cfg.get(k) for k in keys},
        "prepare": steps,
        "summary": summary,
        "prefill_logits_vs_reference": compare_logits(paths, args.backends),
        "notes": [],
        "wall_s": time.perf_counter() - t_start,
        "runs": runs,
    }
    data["notes"] = notes(summary, data["prefill_logits_vs_reference"])
    text = report(data)
    write_results(RESULTS / stem, data, text, partial(plot, data))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export the full-size E2B preset two ways and compare wall time, peak memory and output size.

  (a) ExecuTorch 1.5.1's own Gemma 4 exporter, shipped in the wheel
      (`executorch/examples/models/gemma4/export_gemma4.py`): text only (`--no-audio
      --no-vision`), its default quantization `8da4w+emb8` (int8 dynamic activations, int4
      weights, here group 32; token and per-layer tables int8 per row), XNNPACK, one method
      `text_decoder`, no drafter.
  (b) ours: `edgemtp export --quant q4_0 --backend executorch --delegate cpu`: target + MTP
      drafter in one program, host tables beside it.

Both start from the same random-weight bf16 checkpoint (`edgemtp synth --preset e2b` and
`--preset e2b-assistant`), written once into a cache folder (`--work`) and reused.

ExecuTorch's exporter cannot read our checkpoint as it is, for three reasons found by reading
it (text_decoder/convert_weights.py, gemma4_config.py):
  - it maps only multimodal names, `model.language_model.*`; ours (a text-only HF folder,
    `model_type: gemma4_text`) are `model.*`. The script writes a renamed copy: each
    safetensors header is rewritten and the tensor bytes are copied unchanged, in the kernel
    (`copy_file_range`), so nothing is held in memory;
  - it reads its config only from `config/e2b_config.json` beside the example, which the wheel
    does not ship, so a shim (`python -c`, printed in the report) points `Gemma4Config.from_config`
    at a config built from our checkpoint;
  - that config is read from top-level keys only (`rope_theta`, `rope_local_base_freq`,
    `partial_rotary_factor`, `global_head_dim`), where HF's layout nests them
    (`rope_parameters`, `per_layer_config`): the script flattens them.
Nothing else of the exporter is changed; it runs as shipped (`export_gemma4.main()`).

Each export runs in a fresh process; its peak RSS is the kernel's `ru_maxrss` for exactly that
child (`os.wait4`), and a 1 s sampler follows the RSS of its process group. Memory is shared with
other work on this machine, so a guard kills the exporter (and records that) when its anonymous
memory (RssAnon: what the kernel cannot drop, there is no swap) passes `--mem-limit-gb` (default:
memory available at the start minus 1.5 GiB) or the machine's available memory falls under
0.75 GiB; the child also has the highest OOM-killer score, so the kernel takes it before anything
else. A failure is a result: it is written like one.

Usage:
  python benchmarks/export_e2b.py [--preset e2b|e4b] [--work DIR] [--only ours|executorch]
                                  [--scale F] [--max-context 1024]
Writes benchmarks/results/export_PRESET.{json,md,png} (scaled runs: export_PRESET_s<F>.*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from harness import (
    EDGEMTP,
    GIB,
    REPO,
    RESULTS,
    folder_bytes,
    log,
    machine,
    meminfo,
    pyplot,
    save_figure,
    write_report,
    write_results,
)

ET_PREFIX = "model.language_model."

# Runs ExecuTorch's exporter unchanged, except where its config comes from (the wheel lacks the
# JSON files its `from_config` opens). argv: CONFIG_JSON, then the exporter's own arguments.
ET_SHIM = """\
import sys
from executorch.examples.models.gemma4.text_decoder import gemma4_config as c
path = sys.argv.pop(1)
c.Gemma4Config.from_config = classmethod(lambda cls, variant="e2b": cls.from_json(path))
from executorch.examples.models.gemma4 import export_gemma4
sys.argv[0] = export_gemma4.__file__
export_gemma4.main()
"""

# Top-level keys ExecuTorch's Gemma4Config.from_json reads that HF's text config has as they are.
ET_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "hidden_activation",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "num_kv_shared_layers",
    "use_double_wide_mlp",
    "tie_word_embeddings",
)


# --- machine ------------------------------------------------------------------------------------

# What export results have always recorded of the host: swap too (the memory guard's concern),
# no load average or ONNX Runtime.
HOST_FIELDS = (
    "cpu",
    "cores",
    "memory_gib",
    "available_gib_at_start",
    "swap_gib",
    "os",
    "python",
    "torch",
    "executorch",
    "note",
)
HOST_NOTE = "shared 2-core / 24 GiB machine (other agents' work runs beside it)"


# --- checkpoints --------------------------------------------------------------------------------


def checkpoint_paths(work: Path, scale: float, preset: str = "e2b") -> tuple[Path, Path]:
    tag = "" if scale == 1.0 else f"-s{scale:g}"
    return work / f"{preset}{tag}", work / f"{preset}-assistant{tag}"


def ensure_checkpoints(work: Path, scale: float, model: str = "e2b") -> tuple[Path, Path]:
    """The bf16 target and assistant, written by `edgemtp synth` once and reused."""
    target, drafter = checkpoint_paths(work, scale, model)
    for preset, path in ((model, target), (f"{model}-assistant", drafter)):
        if (path / "config.json").is_file():
            log(f"reusing {path}")
            continue
        log(f"writing {preset} (scale {scale:g}) to {path} ...")
        cmd = [*EDGEMTP, "synth", "--preset", preset, "--scale", str(scale), "--out", str(path)]
        subprocess.run([*cmd, "--force"], check=True, stdout=subprocess.DEVNULL)
    return target, drafter


# --- the checkpoint as ExecuTorch's exporter reads it ------------------------------------------


def executorch_config(config: dict[str, Any]) -> dict[str, Any]:
    """Our HF text config flattened into the top-level keys ExecuTorch's Gemma4Config reads
    (it ignores `rope_parameters` and `per_layer_config`, and would fall back to E2B defaults)."""
    text = config.get("text_config", config)
    types = text["layer_types"]
    rope = text.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    per_layer = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    dims = {
        kind: {
            per_layer.get(i, {}).get("head_dim", text["head_dim"])
            for i, t in enumerate(types)
            if t == kind
        }
        for kind in ("sliding_attention", "full_attention")
    }
    if dims["sliding_attention"] - {text["head_dim"]} or len(dims["full_attention"]) != 1:
        raise SystemExit(f"head dims {dims} cannot be written as ExecuTorch's head_dim/global one")
    if text.get("attention_k_eq_v") or text.get("enable_moe_block"):
        raise SystemExit("ExecuTorch's Gemma 4 example has no k_eq_v attention or MoE block")
    flat = {k: text[k] for k in ET_KEYS if k in text}
    flat["global_head_dim"] = dims["full_attention"].pop()
    flat["rope_theta"] = full.get("rope_theta", text.get("rope_theta", 1e6))
    flat["rope_local_base_freq"] = sliding.get("rope_theta", text.get("rope_local_base_freq", 1e4))
    flat["partial_rotary_factor"] = full.get("partial_rotary_factor", 1.0)
    return flat


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def convert_for_executorch(src: Path, dst: Path) -> dict[str, Any]:
    """A copy of `src` whose tensors carry ExecuTorch's multimodal names (`model.language_model.*`),
    plus its flattened config. Headers are rewritten; tensor bytes are copied as they are by the
    kernel, never through Python memory. Reused when the source has not changed."""
    sources = sorted(src.glob("*.safetensors"))
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sources}
    stamp_file = dst / "converted_from.json"
    config = executorch_config(json.loads((src / "config.json").read_text()))
    if stamp_file.is_file() and json.loads(stamp_file.read_text()).get("files") == stamp:
        log(f"reusing converted checkpoint {dst}")
        return json.loads(stamp_file.read_text())
    need = sum(p.stat().st_size for p in sources)
    dst.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(dst).free < need + GIB:
        raise SystemExit(f"{dst}: {need / GIB:.1f} GiB needed for the renamed copy; free space")
    t0 = time.perf_counter()
    renamed = 0
    for p in sources:
        header, data_start = read_header(p)
        new = {}
        for name, info in header.items():
            if (
                name != "__metadata__"
                and name.startswith("model.")
                and not name.startswith(ET_PREFIX)
            ):
                new[ET_PREFIX + name[len("model.") :]] = info
                renamed += 1
            else:
                new[name] = info
        raw = json.dumps(new, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        size = p.stat().st_size - data_start
        with open(p, "rb") as fin, open(dst / p.name, "wb") as fout:
            fout.write(struct.pack("<Q", len(raw)) + raw)
            fout.flush()
            fin.seek(data_start)
            left = size
            while left:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), min(left, 1 << 30))
                if n == 0:
                    raise SystemExit(f"{p}: short copy")
                left -= n
        log(f"converted {p.name}: {len(header) - 1} tensors, {size / GIB:.2f} GiB")
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    info = {
        "files": stamp,
        "tensors_renamed": renamed,
        "bytes": need,
        "seconds": round(time.perf_counter() - t0, 1),
        "config": config,
    }
    stamp_file.write_text(json.dumps(info, indent=1))
    return info


def executorch_load_estimate(converted: Path, max_context: int) -> dict[str, float]:
    """What ExecuTorch's exporter holds at once while loading, from shapes alone: it builds its
    model in fp32 (`Gemma4ForCausalLM(config)`, here on the meta device, no memory), then
    `convert_hf_to_custom(..., dtype=float32)` makes an fp32 copy of every checkpoint tensor
    (plus a clone of the token table as the untied LM head) before `load_state_dict` copies it
    in. Both are anonymous memory; the bf16 checkpoint itself is only mapped."""
    import torch
    from executorch.examples.models.gemma4.text_decoder.gemma4_config import Gemma4Config
    from executorch.examples.models.gemma4.text_decoder.gemma4_transformer import (
        Gemma4ForCausalLM,
    )

    cfg = Gemma4Config.from_json(str(converted / "config.json"))
    cfg.max_seq_len, cfg.use_custom_sdpa = max_context, False
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    model_bytes += sum(t.numel() * t.element_size() for t in model.buffers())
    numel = 0
    for p in converted.glob("*.safetensors"):
        header, _ = read_header(p)
        numel += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    state_bytes = 4 * (numel + cfg.vocab_size * cfg.hidden_size)  # + the LM head clone
    return {
        "model_fp32_gib": round(model_bytes / GIB, 2),
        "converted_state_dict_fp32_gib": round(state_bytes / GIB, 2),
        "both_at_once_gib": round((model_bytes + state_bytes) / GIB, 2),
    }


# --- measuring one export -----------------------------------------------------------------------


@dataclass
class Measured:
    seconds: float
    returncode: int | None
    peak_rss_mb: float  # kernel ru_maxrss of the child (os.wait4), includes mapped file pages
    sampled_peak_mb: float  # largest 1 s sample of the process group's summed RSS
    sampled_anon_mb: float  # same for anonymous memory only (what the kernel cannot drop)
    killed: str | None  # why the guard killed it, if it did
    cpu_s: float = 0.0  # user + system CPU seconds of the child (wall time includes waiting)
    loadavg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at start and end
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # s, RSS, anon MB
    stages: list[tuple[float, str]] = field(default_factory=list)  # (s, progress line)
    log_tail: list[str] = field(default_factory=list)


def group_memory(pgid: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) in bytes summed over the processes in group `pgid` (the exporter and
    any children). Mapped checkpoint pages count in RSS but the kernel can drop them; anonymous
    memory it cannot (no swap here), so the guard watches that."""
    rss = anon = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:  # pgrp
                continue
            for line in Path(f"/proc/{d}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith(("RssAnon:", "RssShmem:")):
                    anon += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return rss, anon


def _oom_first() -> None:
    """In the child: be the kernel's first choice if memory runs out, not someone else's job."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def measure(
    label: str,
    cmd: list[str],
    log_path: Path,
    env: dict[str, str],
    stage_re: re.Pattern[str],
    mem_limit: int,
    timeout_s: float,
    every_s: float,
) -> Measured:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    with open(log_path, "wb") as logf:
        t0 = time.perf_counter()
        child = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=_oom_first,
        )
        reader = open(log_path, errors="replace")
        pending = ""
        stages: list[tuple[float, str]] = []
        timeline: list[tuple[float, float]] = []
        sampled = sampled_anon = 0
        killed = None
        term_at = None
        last_print = last_line = ""
        next_print = every_s
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            elapsed = time.perf_counter() - t0
            pending += reader.read()
            *lines, pending = pending.split("\n")
            for line in lines:
                line = line.rstrip()
                if line:
                    last_line = line
                if stage_re.search(line):
                    stages.append((round(elapsed, 1), line[:200]))
                    log(f"{label} {elapsed:7.1f}s | {line[:150]}")
            if pid:
                break
            rss, anon = group_memory(child.pid)
            sampled, sampled_anon = max(sampled, rss), max(sampled_anon, anon)
            if not timeline or elapsed - timeline[-1][0] >= 5:
                timeline.append((round(elapsed, 1), round(rss / 2**20), round(anon / 2**20)))
            available = meminfo()["MemAvailable"]
            if not killed and (anon > mem_limit or available < 0.75 * GIB):
                killed = (
                    f"memory guard after {elapsed:.0f} s: anonymous RSS {anon / GIB:.1f} GiB "
                    f"(limit {mem_limit / GIB:.1f} GiB), RSS {rss / GIB:.1f} GiB, machine's "
                    f"available memory {available / GIB:.2f} GiB"
                )
                log(f"{label}: killing: {killed}")
                os.killpg(child.pid, signal.SIGKILL)
            elif not killed and elapsed > timeout_s:
                killed = f"timeout after {timeout_s:.0f} s"
                log(f"{label}: stopping: {killed}")
                os.killpg(child.pid, signal.SIGTERM)  # ours cleans up its temporary folders
                term_at = elapsed
            elif term_at is not None and elapsed > term_at + 30:
                os.killpg(child.pid, signal.SIGKILL)
                term_at = None
            if elapsed >= next_print:
                next_print += every_s
                line = last_line[:110]
                if line == last_print:
                    line = "..."
                last_print = last_line[:110]
                mem = f"rss {rss / GIB:5.2f} anon {anon / GIB:5.2f} GiB"
                log(f"{label} {elapsed:7.1f}s {mem} | {line}")
            time.sleep(1.0)
        child.returncode = os.waitstatus_to_exitcode(status)
        pending += reader.read()
        reader.close()
    tail = log_path.read_text(errors="replace").splitlines()[-40:]
    return Measured(
        seconds=round(elapsed, 1),
        returncode=child.returncode,
        peak_rss_mb=round(usage.ru_maxrss / 1024, 1),
        sampled_peak_mb=round(sampled / 2**20, 1),
        sampled_anon_mb=round(sampled_anon / 2**20, 1),
        killed=killed,
        cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
        loadavg=(load_start, os.getloadavg()[0]),
        timeline=timeline,
        stages=stages,
        log_tail=tail,
    )


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def shell(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


# --- (a) ExecuTorch's exporter ------------------------------------------------------------------


def run_executorch(args: argparse.Namespace, target: Path, work: Path, tag: str) -> dict:
    converted = work / f"{target.name}-executorch-names"
    conversion = convert_for_executorch(target, converted)
    estimate = executorch_load_estimate(converted, args.max_context)
    log(
        f"executorch: its load step holds an fp32 model ({estimate['model_fp32_gib']} GiB) and an "
        f"fp32 converted state dict ({estimate['converted_state_dict_fp32_gib']} GiB) at once: "
        f"{estimate['both_at_once_gib']} GiB; guard at {args.mem_limit / GIB:.1f} GiB"
    )
    out_dir = work / f"executorch{tag}-ctx{args.max_context}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    pte = out_dir / "gemma4_text.pte"
    exporter_args = [
        "--checkpoint_path",
        str(converted),
        "--output_path",
        str(pte),
        "--max_seq_len",
        str(args.max_context),
        "--quantize",
        "8da4w+emb8",
        "--group_size",
        "32",
        "--no-audio",
        "--no-vision",
    ]
    cmd = [sys.executable, "-c", ET_SHIM, str(converted / "config.json"), *exporter_args]
    log(f"executorch: exporting ({shell(exporter_args)})")
    m = measure(
        "executorch",
        cmd,
        work / "logs" / f"executorch{tag}.log",
        child_env(args.threads),
        re.compile(r"^INFO:(__main__|executorch\.examples)|Error|Killed|Traceback"),
        args.mem_limit,
        args.timeout,
        args.progress_every,
    )
    ok = m.returncode == 0 and pte.is_file()
    files = {f.name: f.stat().st_size for f in sorted(out_dir.iterdir())} if ok else {}
    log_text = "\n".join(m.log_tail)
    full_log = (work / "logs" / f"executorch{tag}.log").read_text(errors="replace")
    missing = re.search(r"Missing keys \((\d+)\): (\[.*?\])", full_log)
    return {
        "exporter": "executorch",
        "name": "ExecuTorch 1.5.1 examples/models/gemma4 (8da4w+emb8, group 32)",
        "status": status(ok, m),
        "command": shell(
            [sys.executable, "-c", "<ET_SHIM>", str(converted / "config.json"), *exporter_args]
        ),
        "measured": asdict(m),
        "files": files,
        "bytes": sum(files.values()),
        "methods": program_methods(pte) if ok else [],
        "parts": (
            "target only: one method `text_decoder` (dynamic 1..max_seq_len-1 rows, prefill and "
            "decode), token embedding and per-layer embedding tables int8 per row INSIDE the "
            "program, an untied 8da4w copy of the LM head, fp32 KV caches of max_seq_len for every "
            "storing layer, two fp32 max_seq_len^2 masks; no drafter, no host tables"
        ),
        "conversion": {k: v for k, v in conversion.items() if k != "files"},
        "load_estimate": estimate,
        "skipped_linears": len(re.findall(r"Skipping .*incompatible", full_log)),
        "missing_keys": (
            {"count": int(missing.group(1)), "first": missing.group(2)[:300]} if missing else None
        ),
        "error_tail": [] if ok else log_text.splitlines()[-12:],
    }


def status(ok: bool, m: Measured) -> str:
    if ok:
        return "ok"
    return f"killed: {m.killed}" if m.killed else f"failed (exit {m.returncode})"


def program_methods(pte: Path) -> list[str]:
    """Method names of a .pte, read by ExecuTorch's runtime in a separate process."""
    code = (
        "import sys; from executorch.runtime import Runtime; "
        "print(','.join(sorted(Runtime.get().load_program(sys.argv[1]).method_names)))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(pte)], capture_output=True, text=True, check=False
    )
    return r.stdout.strip().split(",") if r.returncode == 0 and r.stdout.strip() else []


# --- (b) ours -----------------------------------------------------------------------------------


def ours_available(backend: str) -> str | None:
    """None when `edgemtp export --backend BACKEND` can run, else why not."""
    r = subprocess.run(
        [sys.executable, "-c", f"from edgemtp.export.{backend} import lower_{backend}"],
        capture_output=True,
        text=True,
        env=child_env(1),
        cwd=REPO,
        check=False,
    )
    if r.returncode == 0:
        return None
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def run_ours(args: argparse.Namespace, target: Path, drafter: Path, work: Path, tag: str) -> dict:
    backend = args.ours_backend
    name = f"edgemtp export (q4_0, {backend}/cpu, target + MTP drafter)"
    why = ours_available(backend)
    if why is not None:
        log(f"ours: not available yet ({why})")
        return {"exporter": "ours", "name": name, "status": f"not available: {why}"}
    bundle = work / f"ours{tag}-ctx{args.max_context}" / "bundle"
    shutil.rmtree(bundle.parent, ignore_errors=True)
    bundle.parent.mkdir(parents=True)
    export_args = [
        "export",
        "--model",
        str(target),
        "--drafter",
        str(drafter),
        "--quant",
        "q4_0",
        "--backend",
        backend,
        "--delegate",
        "cpu",
        "--max-context",
        str(args.max_context),
        "--out",
        str(bundle),
    ]
    log(f"ours: exporting (edgemtp {shell(export_args)})")
    m = measure(
        "ours",
        [*EDGEMTP, *export_args],
        work / "logs" / f"ours{tag}.log",
        child_env(args.threads),
        re.compile(r"^\[\s*[\d.]+s\]|^wrote |error|Traceback|Killed"),
        args.mem_limit,
        args.timeout,
        args.progress_every,
    )
    manifest_path = bundle / "manifest.json"
    ok = m.returncode == 0 and manifest_path.is_file()
    manifest = json.loads(manifest_path.read_text()) if ok else {}
    files = (
        {
            str(f.relative_to(bundle)): f.stat().st_size
            for f in sorted(bundle.rglob("*"))
            if f.is_file()
        }
        if ok
        else {}
    )
    methods = sorted(manifest.get("methods", {}))
    tables = manifest.get("quantization", {}).get("tables", {})
    return {
        "exporter": "ours",
        "name": name,
        "status": status(ok, m),
        "command": "edgemtp " + shell(export_args),
        "measured": asdict(m),
        "files": files,
        "bytes": sum(files.values()),
        "methods": methods,
        "parts": (
            f"target + MTP drafter, {len(methods)} methods ({', '.join(methods)}) sharing one KV "
            f"cache; host tables beside the program "
            f"({', '.join(f'{k} {v}' for k, v in tables.items()) or 'tables.safetensors'})"
            if ok
            else "target + MTP drafter + host tables"
        ),
        "program": manifest.get("program"),
        "numerics": manifest.get("numerics"),
        "error_tail": [] if ok else m.log_tail[-12:],
    }


# --- report -------------------------------------------------------------------------------------


def fmt_row(r: dict) -> list[str]:
    m = r.get("measured")
    if not m:
        return [r["name"], short_status(r["status"]), "-", "-", "-", "-", "-", "-"]
    size = f"{r['bytes'] / GIB:.2f} GiB" if r.get("bytes") else "-"
    return [
        r["name"],
        short_status(r["status"]),
        f"{m['seconds']:.0f}",
        f"{m['cpu_s']:.0f}" if m.get("cpu_s") else "-",
        f"{m['peak_rss_mb'] / 1024:.2f}",
        f"{m['sampled_anon_mb'] / 1024:.2f}" if "sampled_anon_mb" in m else "-",
        size,
        r.get("parts", ""),
    ]


def markdown(report: dict) -> str:
    preset = report.get("preset", "e2b").upper()
    head = [
        "exporter",
        "status",
        "wall s",
        "CPU s",
        "peak RSS GiB",
        "peak anon GiB",
        "output",
        "contains",
    ]
    lines = [
        f"# Export of the {preset} preset (scale {report['scale']:g}, max context "
        f"{report['max_context']})",
        "",
        f"Run {report['date']} on {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"{report['machine']['memory_gib']} GiB RAM ({report['machine']['available_gib_at_start']}"
        f" GiB available at the start, swap {report['machine']['swap_gib']} GiB), "
        f"{report['threads']} thread(s) per exporter; torch {report['machine']['torch']}, "
        f"executorch {report['machine']['executorch']}.",
        f"Checkpoint: {report['checkpoint']['target']} ({report['checkpoint']['target_gib']:.2f} "
        f"GiB bf16) + {report['checkpoint']['drafter']} "
        f"({report['checkpoint']['drafter_gib']:.2f} GiB).",
        f"Memory guard: {report['mem_limit_gib']:.1f} GiB.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in report["results"].values():
        lines.append("| " + " | ".join(fmt_row(r)) + " |")
    lines += [
        "",
        "Peak RSS is the kernel's ru_maxrss for the exporting process (it counts mapped checkpoint",
        "pages too); peak anon is the largest 1 s sample of its anonymous memory (RssAnon, which",
        "the kernel cannot drop; there is no swap). CPU s is the child's user + system time: wall",
        "time on this shared machine includes waiting for a core.",
        "",
        "## Commands",
        "",
    ]
    for r in report["results"].values():
        if "command" in r:
            lines += [f"{r['exporter']} ({r.get('date', '?')}), run by and then as:", "", "```bash"]
            lines += [r.get("script_command", report["command"]), r["command"], "```", ""]
    et = report["results"].get("executorch", {})
    if "command" in et:
        lines += ["`<ET_SHIM>` is this program (it only replaces where the config comes from):", ""]
        lines += ["```python", ET_SHIM.rstrip(), "```", ""]
    if et.get("conversion"):
        c = et["conversion"]
        lines += [
            "## Conversion for ExecuTorch's exporter",
            "",
            f"{c['tensors_renamed']} tensors renamed `model.*` -> `model.language_model.*`, "
            f"{c['bytes'] / GIB:.2f} GiB copied unchanged in {c['seconds']} s (not counted in the "
            "exporter's time). Flattened config:",
            "",
            "```json",
            json.dumps(c["config"], indent=None),
            "```",
            "",
        ]
        if et.get("missing_keys"):
            lines += [
                f"ExecuTorch's model reported {et['missing_keys']['count']} missing keys "
                "(left at its random init): k_proj, v_proj and k_norm of the KV-shared layers, "
                "which it builds but never uses, and which our checkpoint does not store.",
                "",
            ]
    if et.get("load_estimate"):
        e = et["load_estimate"]
        lines += [
            "## ExecuTorch's exporter: memory at load (from shapes)",
            "",
            f"It builds its model in fp32 ({e['model_fp32_gib']} GiB), then converts every "
            f"checkpoint tensor to a new fp32 copy ({e['converted_state_dict_fp32_gib']} GiB, "
            "with a clone of the token table as an untied LM head) before `load_state_dict`: "
            f"{e['both_at_once_gib']} GiB of anonymous memory at once, before any quantization.",
            "",
        ]
    for r in report["results"].values():
        if r.get("files"):
            lines += [f"## Files: {r['exporter']}", "", "| file | MiB |", "|---|---|"]
            lines += [f"| {f} | {b / 2**20:.1f} |" for f, b in r["files"].items()]
            lines.append("")
        if r.get("numerics"):
            lines += [f"Numerics ({r['exporter']}): " + json.dumps(r["numerics"]), ""]
        m = r.get("measured")
        if m and m["stages"]:
            lines += [f"## Stages: {r['exporter']}", ""]
            lines += [f"- {t:.0f} s: {s}" for t, s in m["stages"]]
            lines.append("")
        if r["status"] != "ok":
            lines += [f"## Not completed: {r['exporter']}", "", r["status"], ""]
        if r.get("error_tail"):
            lines += ["Last lines of its log:", "", "```", *r["error_tail"], "```", ""]
    return "\n".join(lines)


def short_status(status: str) -> str:
    if "memory guard" in status:
        return "killed (memory guard)"
    return status.split(":")[0]


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    preset = report.get("preset", "e2b").upper()
    rows = list(report["results"].values())
    labels = [
        "ExecuTorch example\n(target only)"
        if r["exporter"] == "executorch"
        else "edgemtp\n(target+drafter+tables)"
        for r in rows
    ]
    colors = ["tab:gray" if r["exporter"] == "executorch" else "tab:blue" for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [
        ("wall time (s)", lambda r: r["measured"]["seconds"]),
        ("peak RSS (GiB)", lambda r: r["measured"]["peak_rss_mb"] / 1024),
        ("output size (GiB)", lambda r: r.get("bytes", 0) / GIB),
    ]
    for ax, (title, value) in zip(axes, panels, strict=False):
        for i, r in enumerate(rows):
            ok = r["status"] == "ok"
            v = value(r) if r.get("measured") else 0.0
            if v > 0:
                ax.bar(i, v, color=colors[i], hatch=None if ok else "//", alpha=1 if ok else 0.5)
            note = (
                (f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}") if v else "none"
            )
            if not ok:
                note += "\n" + short_status(r["status"])
            ax.text(i, v, note, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-3) * 1.15)
        ax.set_title(title)
        if title.startswith("peak") and report["scale"] == 1.0:
            ram = report["machine"]["memory_gib"]
            ax.axhline(ram, color="red", lw=0.8, ls="--")
            ax.text(-0.5, ram, "machine RAM", color="red", fontsize=7, va="bottom")
            need = report["results"].get("executorch", {}).get("load_estimate")
            if need:
                i = [r["exporter"] for r in rows].index("executorch")
                ax.plot([i - 0.4, i + 0.4], [need["both_at_once_gib"]] * 2, color="k", ls=":")
                ax.text(
                    i,
                    need["both_at_once_gib"],
                    "needed at load (from shapes)",
                    fontsize=7,
                    ha="center",
                    va="bottom",
                )
                ax.set_ylim(0, need["both_at_once_gib"] * 1.15)
    ax = axes[3]
    for r, c in zip(rows, colors, strict=True):
        if r.get("measured") and r["measured"]["timeline"]:
            t, mb, *anon = zip(*r["measured"]["timeline"], strict=True)
            ax.plot(t, [x / 1024 for x in mb], color=c, label=f"{r['exporter']} RSS")
            if anon:
                ax.plot(t, [x / 1024 for x in anon[0]], color=c, ls=":", label="anonymous")
    ax.set_title("exporter RSS over time (GiB)")
    ax.set_xlabel("s")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"{preset} preset export (scale {report['scale']:g}, "
        f"max context {report['max_context']}), "
        f"{report['machine']['cores']} cores / {report['machine']['memory_gib']} GiB",
        fontsize=10,
    )
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path.home() / ".cache" / "edgemtp" / "e2b-bench",
        help="cache folder for the checkpoints, the renamed copy and the outputs (~25 GB at full "
        "size)",
    )
    ap.add_argument("--preset", choices=["e2b", "e4b"], default="e2b", help="model to export")
    ap.add_argument("--only", choices=["ours", "executorch"], help="run one exporter")
    ap.add_argument("--scale", type=float, default=1.0, help="synth --scale (dry runs: 0.1)")
    ap.add_argument("--max-context", type=int, default=1024, help="cache length for both")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per exporter")
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        help="kill an exporter whose anonymous memory passes this (GiB)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per exporter")
    ap.add_argument("--progress-every", type=float, default=30, help="seconds between lines")
    ap.add_argument("--out", type=Path, help="results stem (default results/export_PRESET[_sF])")
    ap.add_argument(
        "--ours-backend",
        default="executorch",
        choices=["executorch", "onnx", "coreml"],
        help="backend for (b); only to check this script against another backend",
    )
    ap.add_argument("--replot", action="store_true", help="rewrite .md/.png from the .json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # this process only builds a meta-device model and plots
    start_mem = meminfo()
    args.mem_limit = int(
        args.mem_limit_gb * GIB if args.mem_limit_gb else start_mem["MemAvailable"] - 1.5 * GIB
    )
    tag = "" if args.scale == 1.0 else f"-s{args.scale:g}"
    stem = args.out or RESULTS / (f"export_{args.preset}" + tag.replace("-", "_"))
    json_path, md_path, png_path = (Path(f"{stem}{ext}") for ext in (".json", ".md", ".png"))
    if args.replot:
        report = json.loads(json_path.read_text())
        write_report(stem, markdown(report), partial(plot, report))
        log(f"rewrote {md_path} and {png_path}")
        return
    log(
        f"memory: {start_mem['MemAvailable'] / GIB:.1f} GiB available of "
        f"{start_mem['MemTotal'] / GIB:.1f}; guard at {args.mem_limit / GIB:.1f} GiB"
    )
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter = ensure_checkpoints(args.work, args.scale, args.preset)

    previous = {}
    if json_path.is_file():
        prior = json.loads(json_path.read_text())
        if prior.get("scale") == args.scale and prior.get("max_context") == args.max_context:
            previous = prior.get("results", {})
    results: dict[str, dict] = {}
    for exporter in ("executorch", "ours"):
        if args.only and args.only != exporter:
            if exporter in previous:
                results[exporter] = previous[exporter]
                log(f"{exporter}: kept from {json_path} ({previous[exporter]['status']})")
            continue
        if exporter == "executorch":
            r = run_executorch(args, target, args.work, tag)
        else:
            r = run_ours(args, target, drafter, args.work, tag)
        r["date"] = datetime.date.today().isoformat()
        r["script_command"] = shell([Path(sys.executable).name, *sys.argv])
        results[exporter] = r
        if r.get("measured"):
            m = r["measured"]
            log(
                f"{exporter}: {r['status']}, {m['seconds']:.0f} s, peak RSS "
                f"{m['peak_rss_mb'] / 1024:.2f} GiB, output {r.get('bytes', 0) / GIB:.3f} GiB"
            )

    report = {
        "command": shell([Path(sys.executable).name, *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "preset": args.preset,
        "scale": args.scale,
        "max_context": args.max_context,
        "threads": args.threads,
        "mem_limit_gib": args.mem_limit / GIB,
        "machine": machine(fields=HOST_FIELDS, note=HOST_NOTE),
        "checkpoint": {
            "target": f"synth --preset {args.preset} --scale {args.scale:g} (bf16)",
            "drafter": f"synth --preset {args.preset}-assistant --scale {args.scale:g} (bf16)",
            "target_gib": folder_bytes(target) / GIB,
            "drafter_gib": folder_bytes(drafter) / GIB,
        },
        "results": results,
    }
    text = markdown(report)
    write_results(stem, report, text, partial(plot, report))
    print(text)
    log(f"wrote {json_path}, {md_path.name} and {png_path.name}")


if __name__ == "__main__":
    main()

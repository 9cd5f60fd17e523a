"""Soak: a long MTP run and a long chat on one session, with resident memory and open files.

    python benchmarks/soak.py [--bundle DIR] [--tokens 10000] [--turns 50] [--out DIR]

The embedded default pair's demo bundle (`edgemtp demo`'s: Q4_0 ExecuTorch XNNPACK, max context
512, draft depth 3; exported once by `cli.demo.ensure_bundle` and cached) is opened once with
`Session.from_bundle` (1 thread), and that one session runs both parts:

  1. generate: `session.generate(prompt, budget, stop_ids=())` over varied prompts until at least
     `--tokens` tokens are committed. Prompts: the demo's held-out prompts, then one per `def`
     in this Python's held-out standard-library files (the files the pair never trained on);
     budget `--gen-tokens` (256), less where the prompt leaves less room. The calls cycle through
     mtp="auto" greedy, depth 3 greedy, "auto" sampled, depth 3 sampled (temperature 0.8,
     top-p 0.95, seeded), so AR and MTP rounds and both accept rules run.
  2. chat: `--turns` turns of a conversation, each a short user message (the last lines before a
     `def`) and a reply of up to `--reply-tokens` (64; the session's stop tokens). The history
     is rendered the way `PromptTokenizer.encode_prompt(chat=True)` renders one turn, repeated:
     <bos> then per turn `<|turn>user\\n{text}<turn|>\\n<|turn>model\\n`, the reply's ids as
     generated, `<turn|>\\n`. When the prompt plus the reply budget would exceed the context, the
     oldest turns are dropped: the prompt then diverges from the cache after <bos> and the
     session prefills it again; otherwise it prefills only the new turn.

After every generation or turn: resident memory (/proc/self/statm via `runtime.probes`, with the
anonymous / file-backed split of /proc/self/status), open file descriptors (/proc/self/fd) and
the number of objects the garbage collector tracks. Warm-up is the first 10 % (`--warmup`) of
each part's generations or turns; after it, resident memory should stay within +-5 % of its
first value (drift = (last - first) / first) and the open descriptors constant.

Writes OUT/soak.json (every sample, the summary, the machine, the command, the git commit),
OUT/soak.md and OUT/soak.png. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from harness import REPO, RESULTS, machine, pyplot, save_figure, write_results

from edgemtp.cli.demo import DemoSettings, ensure_bundle
from edgemtp.model.embedded import ASSISTANT, PROMPTS, TARGET
from edgemtp.runtime.probes import current_rss_mb
from edgemtp.runtime.sampling import SamplingParams
from edgemtp.runtime.session import Session
from edgemtp.runtime.tokenizer import PromptTokenizer

TOLERANCE = 0.05  # resident memory after warm-up stays within +-5 %
DEF_LINE = re.compile(r"^[ \t]*(async[ \t]+)?def [^\n]*:[ \t]*$", re.MULTILINE)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
MODES: tuple[tuple[str, int | str, bool], ...] = (  # (label, mtp, sampled)
    ("auto", "auto", False),
    ("mtp3", 3, False),
    ("auto-sampled", "auto", True),
    ("mtp3-sampled", 3, True),
)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- prompts -------------------------------------------------------------------------------------


def stdlib_prompts(context_lines: int) -> list[str]:
    """One prompt per `def` line in this Python's held-out standard-library files: the line and
    the `context_lines - 1` lines before it (the pair's held-out split, `train.data`)."""
    from edgemtp.train.data import is_held_out, read_source, source_files, stdlib_dir

    root = stdlib_dir()
    prompts = []
    for rel in source_files(root):
        if not is_held_out(rel):
            continue
        text = read_source(root, rel)
        for match in DEF_LINE.finditer(text or ""):
            lines = text[: match.end()].split("\n")  # type: ignore[index]
            prompts.append("\n".join(lines[-context_lines:]) + "\n")
    return prompts


def prompt_texts(context_lines: int) -> list[str]:
    demo = json.loads(PROMPTS.read_text()) if PROMPTS.is_file() else []
    return [*demo, *stdlib_prompts(context_lines)] or ["def "]


class ChatRenderer:
    """Multi-turn prompts in the runtime's chat format, built from per-turn encodings so that an
    earlier turn's ids never change (and the session can reuse their cache)."""

    def __init__(self, tokenizer: PromptTokenizer):
        if tokenizer.turn is None:
            raise SystemExit("the bundle's tokenizer has no turn markers: no chat to soak")
        self.tok = tokenizer.tokenizer
        self.start, self.end = tokenizer.turn
        self.end_id = self.tok.token_to_id(self.end)
        self.bos = self.tok.encode("x").ids[:1]  # what encoding prepends (<bos>)
        # One turn rendered this way must equal the runtime's own single-turn rendering.
        probe = "def f(x):\n"
        if tokenizer.encode_prompt(probe, chat=True) != self.bos + self.user(probe):
            raise SystemExit("per-turn chat encoding differs from encode_prompt(chat=True)")

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def user(self, text: str) -> list[int]:
        return self._ids(f"{self.start}user\n{text}{self.end}\n{self.start}model\n")

    def close(self, reply: list[int]) -> list[int]:
        """After a reply: `<turn|>\\n`, or just the newline when the model ended its turn."""
        return self._ids("\n" if reply and reply[-1] == self.end_id else f"{self.end}\n")

    def render(self, history: list[tuple[list[int], list[int]]], user: list[int]) -> list[int]:
        ids = list(self.bos)
        for turn_user, reply in history:
            ids += turn_user + reply + self.close(reply)
        return ids + user


# --- sampling the process ------------------------------------------------------------------------


def status_mb(field: str) -> float | None:
    """A kB field of /proc/self/status (RssAnon, RssFile, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return None


def probe() -> dict[str, Any]:
    return {
        "rss_mb": current_rss_mb(),
        "rss_anon_mb": status_mb("RssAnon"),
        "rss_file_mb": status_mb("RssFile"),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "gc_objects": len(gc.get_objects()),
    }


@dataclass
class Tally:
    tokens: int = 0
    t0: float = 0.0


def record(
    part: str, index: int, counter: Tally, result: Any, extra: dict[str, Any]
) -> dict[str, Any]:
    m = result.metrics()
    counter.tokens += len(result.tokens)
    return {
        "part": part,
        "index": index,
        **extra,
        "prompt_tokens": m["prompt_tokens"],
        "reused_prompt_tokens": m["reused_prompt_tokens"],
        "generated_tokens": m["generated_tokens"],
        "tokens_so_far": counter.tokens,
        "stop_reason": result.stop_reason,
        "decode_tok_s": m["decode_tok_s"],
        "prefill_tok_s": m["prefill_tok_s"],
        "mean_committed_per_forward": m["mean_committed_per_forward"],
        "mtp_depths_used": m["mtp_depths_used"],
        "wall_s": result.t_end - result.t_start,
        "elapsed_s": time.perf_counter() - counter.t0,
        **probe(),
    }


# --- the two parts -------------------------------------------------------------------------------


def run_generate(
    session: Session, prompts: list[list[int]], tokens: int, budget: int
) -> list[dict[str, Any]]:
    counter = Tally(t0=time.perf_counter())
    samples: list[dict[str, Any]] = []
    limit = session.backend.max_context
    usable = [p for p in prompts if len(p) + 16 <= limit]
    while counter.tokens < tokens:
        i = len(samples)
        prompt = usable[i % len(usable)]
        label, mtp, sampled = MODES[i % len(MODES)]
        params = replace(SAMPLED, seed=i) if sampled else None
        n = min(budget, limit - len(prompt), tokens - counter.tokens)
        result = session.generate(prompt, max(n, 1), mtp=mtp, params=params, stop_ids=())
        sample = record("generate", i, counter, result, {"mode": label})
        samples.append(sample)
        say(
            f"generate {i + 1}: {label:12s} {sample['generated_tokens']:3d} tokens "
            f"({counter.tokens}/{tokens}), {sample['decode_tok_s'] or 0:.0f} tok/s, "
            f"RSS {sample['rss_mb']:.1f} MiB, {sample['open_fds']} fds"
        )
        del result
    return samples


def run_chat(
    session: Session, renderer: ChatRenderer, messages: list[str], turns: int, reply: int
) -> list[dict[str, Any]]:
    counter = Tally(t0=time.perf_counter())
    samples: list[dict[str, Any]] = []
    limit = session.backend.max_context
    history: list[tuple[list[int], list[int]]] = []
    for i in range(turns):
        user = renderer.user(messages[i % len(messages)])
        dropped = 0
        while len(renderer.render(history, user)) + reply > limit:
            if not history:
                raise SystemExit(f"a {len(user)}-token message leaves no room for the reply")
            history.pop(0)
            dropped += 1
        prompt = renderer.render(history, user)
        result = session.generate(prompt, reply)
        history.append((user, result.tokens))
        extra = {"mode": "auto", "turns_kept": len(history), "turns_dropped": dropped}
        sample = record("chat", i, counter, result, extra)
        samples.append(sample)
        say(
            f"chat turn {i + 1}/{turns}: prompt {sample['prompt_tokens']} "
            f"(reused {sample['reused_prompt_tokens']}), dropped {dropped}, reply "
            f"{sample['generated_tokens']} ({result.stop_reason}), RSS {sample['rss_mb']:.1f} MiB, "
            f"{sample['open_fds']} fds"
        )
        del result
    return samples


# --- summary, report, plot -----------------------------------------------------------------------


def warmup_count(samples: list[dict[str, Any]], fraction: float) -> int:
    return max(1, math.ceil(fraction * len(samples)))


def summarize(samples: list[dict[str, Any]], fraction: float, wall_s: float) -> dict[str, Any]:
    warm = warmup_count(samples, fraction)
    after = samples[warm:] or samples[-1:]
    rss = [s["rss_mb"] for s in after]
    fds = [s["open_fds"] for s in after]
    drift = (rss[-1] - rss[0]) / rss[0]
    speeds = [s["decode_tok_s"] for s in samples if s["decode_tok_s"]]
    by_mode: dict[str, list[float]] = {}
    for s in samples:
        if s["decode_tok_s"]:
            by_mode.setdefault(s["mode"], []).append(s["decode_tok_s"])
    return {
        "calls": len(samples),
        "warmup_calls": warm,
        "warmup_tokens": samples[warm - 1]["tokens_so_far"],
        "tokens": samples[-1]["tokens_so_far"],
        "wall_s": wall_s,
        "decode_tok_s_median": statistics.median(speeds) if speeds else None,
        "decode_tok_s_median_by_mode": {k: statistics.median(v) for k, v in by_mode.items()},
        "rss_mb_after_first_call": samples[0]["rss_mb"],
        "rss_mb_first_after_warmup": rss[0],
        "rss_mb_last": rss[-1],
        "rss_mb_min_after_warmup": min(rss),
        "rss_mb_max_after_warmup": max(rss),
        "rss_drift": drift,
        "rss_spread": (max(rss) - min(rss)) / rss[0],
        "rss_within_tolerance": abs(drift) <= TOLERANCE
        and max(abs(r - rss[0]) for r in rss) <= TOLERANCE * rss[0],
        "rss_anon_mb_first_after_warmup": after[0]["rss_anon_mb"],
        "rss_anon_mb_last": after[-1]["rss_anon_mb"],
        "open_fds_min_after_warmup": min(fds),
        "open_fds_max_after_warmup": max(fds),
        "open_fds_constant": min(fds) == max(fds),
        "gc_objects_first_after_warmup": after[0]["gc_objects"],
        "gc_objects_last": after[-1]["gc_objects"],
        "stop_reasons": {
            r: sum(s["stop_reason"] == r for s in samples)
            for r in sorted({s["stop_reason"] for s in samples})
        },
        "reprefills": sum(s["reused_prompt_tokens"] <= 1 for s in samples),
    }


def report(result: dict[str, Any]) -> str:
    parts = result["summary"]["generate"], result["summary"]["chat"]

    def row(label: str, cell: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | {cell(parts[0])} | {cell(parts[1])} |"

    def mib(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda s: f"{s[key]:.1f} MiB"

    rows = [
        row("tokens committed", lambda s: f"{s['tokens']}"),
        row("calls (of which warm-up)", lambda s: f"{s['calls']} ({s['warmup_calls']})"),
        row("wall time", lambda s: f"{s['wall_s']:.1f} s"),
        row("decode tok/s, median", lambda s: f"{s['decode_tok_s_median']:.0f}"),
        row("prompts prefilled from the start", lambda s: f"{s['reprefills']}"),
        row("RSS after the part's first call", mib("rss_mb_after_first_call")),
        row("RSS first after warm-up", mib("rss_mb_first_after_warmup")),
        row("RSS last", mib("rss_mb_last")),
        row(
            "RSS min / max after warm-up",
            lambda s: (
                f"{s['rss_mb_min_after_warmup']:.1f} / {s['rss_mb_max_after_warmup']:.1f} MiB"
            ),
        ),
        row("RSS drift (last − first) / first", lambda s: f"{s['rss_drift']:+.2%}"),
        row("within ±5 % (drift and every sample)", lambda s: _yes(s["rss_within_tolerance"])),
        row("open fds after warm-up (min–max)", _fds),
        row(
            "gc-tracked objects, first → last",
            lambda s: f"{s['gc_objects_first_after_warmup']} → {s['gc_objects_last']}",
        ),
    ]
    lines = [
        "# Soak: one session, a long MTP run and a long chat",
        "",
        f"`{result['command']}` ({result['date']}, {result['machine']['cpu']}, 1 thread, "
        f"git {result['git_commit'][:12]}{' dirty' if result['git_dirty'] else ''})",
        "",
        f"Bundle: `{result['bundle']}` (embedded pair, Q4_0 ExecuTorch XNNPACK, context "
        f"{result['max_context']}). One `Session` for both parts, generate first; RSS in MiB "
        f"(after loading: {result['after_load']['rss_mb']:.1f} MiB, "
        f"{result['after_load']['open_fds']} open fds).",
        "",
        "| | generate (mtp auto / 3, greedy / sampled) | chat (truncating history) |",
        "|---|---:|---:|",
        *rows,
        "",
        f"Warm-up: {result['warmup']}. RSS is /proc/self/statm's resident set (anonymous plus "
        "file-backed pages: mapped libraries, `model.pte`, `tables.safetensors`); the samples "
        "in `soak.json` also split it. gc-tracked objects are counted without collecting first, "
        "and include the soak's own record of each call (one more object per call).",
    ]
    return "\n".join(lines) + "\n"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _fds(summary: dict[str, Any]) -> str:
    lo, hi = summary["open_fds_min_after_warmup"], summary["open_fds_max_after_warmup"]
    return f"{lo}–{hi} " + ("(constant)" if lo == hi else "(**grew**)")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
    for col, part in enumerate(("generate", "chat")):
        samples = [s for s in result["samples"] if s["part"] == part]
        summary = result["summary"][part]
        x = [s["tokens_so_far"] for s in samples]
        rss_ax, fd_ax = axes[0][col], axes[1][col]
        rss_ax.plot(x, [s["rss_mb"] for s in samples], ".-", label="RSS")
        rss_ax.plot(x, [s["rss_anon_mb"] for s in samples], ".--", label="of which anonymous")
        first = summary["rss_mb_first_after_warmup"]
        rss_ax.axhspan(first * (1 - TOLERANCE), first * (1 + TOLERANCE), color="g", alpha=0.08)
        fd_ax.plot(x, [s["open_fds"] for s in samples], ".-", color="C2")
        for ax in (rss_ax, fd_ax):
            ax.axvspan(0, summary["warmup_tokens"], color="0.5", alpha=0.2, lw=0)
        rss_ax.set_ylim(bottom=0)
        rss_ax.set_ylabel("resident MiB")
        rss_ax.set_title(
            f"{part}: {summary['calls']} {'generations' if part == 'generate' else 'turns'}, "
            f"drift {summary['rss_drift']:+.2%}"
        )
        rss_ax.legend(fontsize=8, loc="lower right")
        fd_ax.set_ylabel("open file descriptors")
        fd_ax.set_ylim(0, max(s["open_fds"] for s in samples) + 5)
        fd_ax.set_xlabel("tokens committed in this part (grey: warm-up; green: ±5 %)")
    fig.suptitle("Soak, embedded pair, Q4_0 ExecuTorch, one session")
    save_figure(fig, path)


def git_state() -> tuple[str, bool]:
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return run.stdout.strip()

    code = ["--", ".", ":!*.md", ":!benchmarks/results"]  # what can change the figures
    return git("rev-parse", "HEAD") or "unknown", bool(git("status", "--porcelain", *code))


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--bundle", type=Path, help="the demo bundle (default: edgemtp demo's, cached)")
    add("--tokens", type=int, default=10_000, help="part 1: tokens to commit (%(default)s)")
    add("--gen-tokens", type=int, default=256, help="part 1: budget per call (%(default)s)")
    add("--turns", type=int, default=50, help="part 2: chat turns (%(default)s)")
    add("--reply-tokens", type=int, default=64, help="part 2: reply budget (%(default)s)")
    add("--warmup", type=float, default=0.1, help="warm-up share of each part (%(default)s)")
    add("--out", type=Path, default=RESULTS, help="for soak.{json,md,png} (benchmarks/results)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    settings = DemoSettings()
    bundle = ensure_bundle(TARGET, ASSISTANT, args.bundle, settings, say)
    session = Session.from_bundle(bundle, threads=settings.threads, verify=False)
    tokenizer = session.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{bundle}: no tokenizer.json")
    renderer = ChatRenderer(tokenizer)
    texts = prompt_texts(12)
    prompts = [tokenizer.encode_prompt(t) for t in texts]
    messages = ["\n".join(t.rstrip("\n").split("\n")[-3:]) + "\n" for t in texts]
    loaded = probe()
    say(f"{len(prompts)} prompts, {len(messages)} chat messages; after loading: {loaded}")

    t0 = time.perf_counter()
    generate = run_generate(session, prompts, args.tokens, args.gen_tokens)
    t1 = time.perf_counter()
    chat = run_chat(session, renderer, messages, args.turns, args.reply_tokens)
    t2 = time.perf_counter()

    commit, dirty = git_state()
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ)
    command = " ".join(x for x in (env, ".venv/bin/python", shlex.join(sys.argv)) if x)
    result = {
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": machine(1),
        "bundle": str(bundle),
        "max_context": session.backend.max_context,
        "after_load": loaded,
        "settings": vars(args) | {"out": str(args.out), "bundle": str(bundle)},
        "warmup": f"the first {args.warmup:.0%} of each part's generations / turns",
        "summary": {
            "generate": summarize(generate, args.warmup, t1 - t0),
            "chat": summarize(chat, args.warmup, t2 - t1),
        },
        "samples": generate + chat,
    }
    text = report(result)
    write_results(args.out / "soak", result, text, partial(plot, result))
    print(text)


if __name__ == "__main__":
    main()

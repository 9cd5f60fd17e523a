"""`edgemtp bench`: llama-bench-style measurements of a bundle, every draft depth on equal terms.

`ppN` prefills an N-token prompt and makes one token (prefill tok/s = N / prefill time); `tgN`
decodes N tokens after a short prompt at each draft depth (decode tok/s = (n_out - 1) /
(t_end - t_first), TTFT apart). Each depth first runs a warm-up, recorded but left out of every
statistic; then `repeat` rounds give every depth the same controlled-cold prompt (cache reset, a
prefix unique to the run), depths interleaved so that a shared machine's drift hits them alike.
A greedy MTP run records whether its tokens equal the AR run's (`valid`); a failed run records
its error; none is dropped. Depth `auto` is the session's adaptive depth (`runtime.adaptive`),
which keeps what it learns across the runs, as in an app's session.

`acceptance_oracle`: each draft is replaced by the AR run's token with probability `rate`, else by
one that cannot be accepted: MTP's mechanics at a controlled acceptance, labelled as such. A run
whose quantized verify breaks a near-tie unlike AR is repeated replaying its own tokens (up to
`ORACLE_PASSES`; the record keeps the last pass, `oracle_passes` counts them), so reports give
the acceptance a run reached beside the rate.

The result (`result_document`) is the JSON the sample apps' benchmark mode writes too
(`runtime/bench.schema.json`); `runtime.bench_report` turns results into tables and plots.
"""

from __future__ import annotations

import hashlib
import os
import platform
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from torch import Tensor

from edgemtp import __version__
from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.backends import Backend
from edgemtp.runtime.sampling import SamplingParams

SCHEMA = "edgemtp-bench/1"
SCHEMA_FILE = Path(__file__).with_name("bench.schema.json")
GREEDY = SamplingParams()
AUTO = "auto"  # the adaptive depth, as `--mtp auto` of generate
ORACLE_PASSES = 3
Say = Callable[[str], None]
Depth = int | str  # a pinned depth (0 = AR) or AUTO


@dataclass(frozen=True)
class BenchPlan:
    pp: tuple[int, ...] = (128, 512, 2048)
    tg: tuple[int, ...] = (128,)
    depths: tuple[Depth, ...] = (0, 1, 2, 3)
    repeat: int = 5
    tg_prompt: int = 32  # prompt tokens before a tg test
    acceptance_oracle: float | None = None
    seed: int = 0

    def check(self, backend: Backend) -> None:
        for name, values in (("--pp", self.pp), ("--tg", self.tg)):
            if any(v < 1 for v in values):
                raise EdgeMTPError(f"{name} {values}: token counts must be >= 1")
        if not self.pp and not self.tg:
            raise EdgeMTPError("nothing to measure: give --pp and/or --tg")
        if self.repeat < 1:
            raise EdgeMTPError(f"--repeat {self.repeat}: run each test at least once")
        if self.tg_prompt < 1:
            raise EdgeMTPError(f"--tg-prompt {self.tg_prompt}: a prompt needs a token")
        pinned = [d for d in self.depths if d != AUTO]
        if any(not isinstance(d, int) for d in pinned):
            raise EdgeMTPError(f"--mtp {self.depths}: depths are integers >= 0 or auto")
        deepest = max(pinned, default=0)
        if deepest and not backend.has_drafter:
            raise EdgeMTPError(f"--mtp {deepest} needs a drafter; this bundle has none (--mtp 0)")
        if AUTO in self.depths and not backend.has_drafter:
            raise EdgeMTPError("--mtp auto adapts the draft depth: this bundle has no drafter")
        if deepest > backend.max_draft:
            raise EdgeMTPError(
                f"--mtp {deepest}: this bundle verifies at most {backend.max_draft} drafts "
                f"(export with --draft-depth {deepest} for more)"
            )
        if min(pinned, default=0) < 0:
            raise EdgeMTPError(f"--mtp {self.depths}: depths are >= 0 (0 = AR)")
        rate = self.acceptance_oracle
        if rate is not None and not 0 <= rate <= 1:
            raise EdgeMTPError(f"--acceptance-oracle {rate}: give a rate in [0, 1]")
        if rate is not None and 0 not in self.depths:
            raise EdgeMTPError("--acceptance-oracle replays the AR run's tokens: include --mtp 0")


# --- prompts -----------------------------------------------------------------------------------


class PromptMaker:
    """Prompts of an exact length, each unique to its run (controlled-cold): a run prefix, then
    text from `texts` (tokenized; repeated until long enough), or seeded random ids when there
    is no tokenizer or no text."""

    def __init__(self, session: Any, texts: Sequence[str], seed: int):
        self.tokenizer, self.vocab = session.tokenizer, session.backend.vocab_size
        self.texts, self.seed = list(texts), seed
        self.special = set(session.stop_ids)

    def make(self, run: str, length: int) -> list[int]:
        if self.tokenizer is None or not self.texts:
            rng = random.Random(f"{self.seed} {run}")
            ordinary = [t for t in range(self.vocab) if t not in self.special] or [0]
            return [rng.choice(ordinary) for _ in range(length)]
        start = int(hashlib.sha256(run.encode()).hexdigest(), 16) % len(self.texts)
        ids = self.tokenizer.encode_prompt(f"# bench run {run}\n")
        i = start
        while len(ids) < length:
            ids += self.tokenizer.encode_prompt(self.texts[i % len(self.texts)])[1:]  # no <bos>
            i += 1
        return ids[:length]


def read_prompt_texts(path: Path) -> list[str]:
    """A prompts file: a JSON list of strings, or plain text with prompts separated by blank
    lines."""
    import json

    try:
        raw = Path(path).read_text()
    except OSError as err:
        raise EdgeMTPError(f"--prompts {path}: cannot read it ({err.strerror})") from None
    if raw.lstrip().startswith("["):
        try:
            texts = json.loads(raw)
        except ValueError as err:
            raise EdgeMTPError(f"--prompts {path}: not valid JSON ({err})") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise EdgeMTPError(f"--prompts {path}: a JSON prompts file is a list of strings")
    else:
        texts = [block.strip() for block in raw.split("\n\n")]
    texts = [t for t in texts if t]
    if not texts:
        raise EdgeMTPError(f"--prompts {path}: no prompts in it")
    return texts


# --- acceptance oracle -------------------------------------------------------------------------


class OracleDrafts:
    """Wraps a backend: the real drafter runs, then its draft is replaced by the target's greedy
    continuation `continuation` (tokens after the prompt) with probability `rate`, else by a
    token the target does not choose there."""

    def __init__(
        self, inner: Backend, continuation: list[int], prompt_len: int, rate: float, seed: str
    ):
        self.inner, self.continuation, self.prompt_len = inner, continuation, prompt_len
        self.rate, self.rng = rate, random.Random(seed)
        self.in_round = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]:
        self.in_round = 0
        return self.inner.verify(ids, position)

    def draft_chain(
        self, token: int, hidden: Tensor, position: int, depth: int
    ) -> list[int] | None:
        return None  # each step's draft is replaced: step by step

    def draft_step(
        self, token: int, hidden: Tensor, position: int
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        import torch

        hidden, _, _ = self.inner.draft_step(token, hidden, position)
        index = position - self.prompt_len + 1 + self.in_round
        self.in_round += 1
        truth = self.continuation[index] if index < len(self.continuation) else 0
        if self.rng.random() >= self.rate:
            truth = (truth + 1) % self.inner.vocab_size
        return hidden, torch.tensor([truth]), torch.zeros(1)


# --- running -----------------------------------------------------------------------------------


def run_bench(session: Any, plan: BenchPlan, texts: Sequence[str], say: Say) -> list[dict]:
    """Every run of every test, warm-ups included (flagged), in the order they ran."""
    plan.check(session.backend)
    prompts = PromptMaker(session, texts, plan.seed)
    limit = session.backend.max_context
    runs: list[dict] = []
    tests = [("pp", n, (0,)) for n in plan.pp] + [("tg", n, plan.depths) for n in plan.tg]
    for kind, n, depths in tests:
        name = f"{kind}{n}"
        prompt_len, gen = (n, 1) if kind == "pp" else (plan.tg_prompt, n)
        deepest = max(session.backend.max_draft if d == AUTO else d for d in depths)
        if prompt_len + gen + deepest + 1 > limit:
            say(
                f"{name}: skipped, {prompt_len} prompt + {gen} generated tokens do not fit the "
                f"bundle's context of {limit}"
            )
            runs.append({"test": name, "skipped": f"does not fit the context of {limit}"})
            continue
        for depth in depths:
            prompt = prompts.make(f"{name} warm-up {depth}", prompt_len)
            runs.append(_run(session, plan, name, depth, -1, prompt, gen, None))
        for r in range(plan.repeat):
            say(f"{name}: round {r + 1}/{plan.repeat}, depths {','.join(map(str, depths))}")
            prompt = prompts.make(f"{name} {r}", prompt_len)
            ar: list[int] | None = None
            for depth in depths:
                record = _run(session, plan, name, depth, r, prompt, gen, ar)
                if depth == 0 and "tokens" in record:
                    ar = record["tokens"]
                runs.append(record)
    return runs


def _run(
    session: Any,
    plan: BenchPlan,
    test: str,
    depth: Depth,
    round_: int,
    prompt: list[int],
    gen: int,
    ar_tokens: list[int] | None,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "test": test,
        "depth": depth,
        "round": round_,
        "warmup": round_ < 0,
        "prompt_tokens": len(prompt),
        "prompt_sha256": hashlib.sha256(str(prompt).encode()).hexdigest()[:16],
        "acceptance_oracle": None,
    }
    backend = session.backend
    oracle = plan.acceptance_oracle is not None and depth != 0
    # a warm-up (or a round whose AR run failed) has nothing to replay: every draft misses
    replay = ar_tokens or []
    passes = ORACLE_PASSES if oracle and replay else 1
    seed = f"{plan.seed} {test} {depth} {round_}"
    for attempt in range(1, passes + 1):
        if oracle:
            record.update(acceptance_oracle=plan.acceptance_oracle, oracle_passes=attempt)
            drafts = OracleDrafts(backend, replay, len(prompt), plan.acceptance_oracle, seed)
            session.backend = drafts  # type: ignore[assignment]
        session.reset()
        try:
            result = session.generate(
                prompt, gen, mtp=depth, params=GREEDY, stop_ids=(), interruptible=False
            )
        except EdgeMTPError as err:
            record["error"] = str(err)
            return record
        finally:
            session.backend = backend
        if result.tokens == replay:
            break
        replay = result.tokens  # verify's own continuation: the next pass replays it
    metrics = result.metrics()
    decode = [s for s in result.steps if s.kind == "decode"]
    record.update(
        tokens=result.tokens,
        generated_tokens=len(result.tokens),
        ttft_s=metrics["ttft_s"],
        prefill_tok_s=metrics["prefill_tok_s"],
        decode_tok_s=metrics["decode_tok_s"],
        decode_s=result.t_end - result.t_first,
        rounds=[[s.drafted, s.accepted] for s in decode],
        decode_seconds_by_phase=metrics["decode_seconds_by_phase"],
        valid=None if depth == 0 or ar_tokens is None else result.tokens == ar_tokens,
        error=None,
    )
    return record


# --- summary -----------------------------------------------------------------------------------


def acceptance_by_position(rounds: Sequence[Sequence[int]]) -> list[float | None]:
    """a_i = P(draft i accepted | drafts before it were), over rounds of (drafted, accepted)."""
    depth = max((k for k, _ in rounds), default=0)
    rates: list[float | None] = []
    for i in range(1, depth + 1):
        tried = sum(1 for k, n in rounds if k >= i and n >= i - 1)
        accepted = sum(1 for k, n in rounds if k >= i and n >= i)
        rates.append(accepted / tried if tried else None)
    return rates


def timed_runs(runs: Sequence[dict], test: str, depth: Depth) -> list[dict]:
    """The runs of one test and depth that count: not warm-ups, not failed."""
    return [
        r
        for r in runs
        if r["test"] == test and r.get("depth") == depth and not r["warmup"] and not r.get("error")
    ]


def summarize(runs: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (test, depth) over its timed runs; `vs_ar` compares medians of one run."""
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["test"], r.get("depth")) for r in runs if "skipped" not in r))
    for test, depth in keys:
        mine = [r for r in runs if r["test"] == test and r.get("depth") == depth]
        timed = [r for r in mine if not r["warmup"]]
        ok = timed_runs(runs, test, depth)
        pp = test.startswith("pp")
        speed = [r["prefill_tok_s" if pp else "decode_tok_s"] for r in ok]
        speed = [s for s in speed if s]
        rounds = [rd for r in ok for rd in r.get("rounds", [])]
        drafted = sum(k for k, _ in rounds)
        accepted = sum(n for _, n in rounds)
        checked = [r["valid"] for r in ok if r.get("valid") is not None]
        rows.append(
            {
                "test": test,
                "depth": depth,
                "acceptance_oracle": mine[0].get("acceptance_oracle"),
                "runs": len(timed),
                "failed": len(timed) - len(ok),
                "metric": "prefill_tok_s" if pp else "decode_tok_s",
                "tok_s_median": statistics.median(speed) if speed else None,
                "tok_s_stdev": statistics.stdev(speed) if len(speed) > 1 else None,
                "tok_s_min": min(speed, default=None),
                "tok_s_max": max(speed, default=None),
                "ttft_ms_median": 1000 * statistics.median(r["ttft_s"] for r in ok) if ok else None,
                "acceptance_rate": accepted / drafted if drafted else None,
                "acceptance_by_position": acceptance_by_position(rounds),
                "committed_per_round": (len(rounds) + accepted) / len(rounds) if rounds else None,
                "ms_per_token_by_phase": _ms_per_token(ok),
                "valid_runs": sum(checked) if checked else None,
                "checked_runs": len(checked),
            }
        )
        if depth == AUTO:  # how often the policy chose each depth (0: an AR step)
            used = Counter(k for k, _ in rounds)
            rows[-1]["depths_used"] = {str(k): used[k] for k in sorted(used)}
    for row in rows:
        ar = next((a for a in rows if a["test"] == row["test"] and a["depth"] == 0), None)
        both = ar and ar["tok_s_median"] and row["tok_s_median"]
        row["vs_ar"] = row["tok_s_median"] / ar["tok_s_median"] if both else None  # type: ignore[index]
    return rows


def _ms_per_token(runs: Sequence[dict]) -> dict[str, float]:
    tokens = sum(r["generated_tokens"] - 1 for r in runs)
    if tokens <= 0:
        return {}
    phases: dict[str, float] = {}
    for r in runs:
        for phase, seconds in r["decode_seconds_by_phase"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return {phase: 1000 * s / tokens for phase, s in phases.items()}


# --- what was measured on what -----------------------------------------------------------------


def machine_info(threads: int) -> dict[str, Any]:
    """The host: CPU, cores, memory, OS, the library versions that run bundles, threads."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    memory: float | None = None
    meminfo = Path("/proc/meminfo")
    available: float | None = None
    if meminfo.is_file():
        fields = {
            ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in meminfo.read_text().splitlines()
        }
        memory = round(fields["MemTotal"] / 2**30, 1)
        available = round(fields.get("MemAvailable", 0) / 2**30, 1)
    libraries = {}
    for package in ("torch", "executorch", "onnxruntime", "coremltools"):
        try:
            libraries[package] = version(package)
        except PackageNotFoundError:
            libraries[package] = None
    return {
        "platform": "host",
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": memory,
        "available_gib_at_start": available,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "edgemtp": __version__,
        "libraries": libraries,
        "threads": threads,
    }


def bundle_info(bundle: Path, session_info: dict[str, Any]) -> dict[str, Any]:
    """The bundle's identity: the SHA-256 of its manifest, which holds every file's SHA-256;
    and the KV cache its programs keep."""
    from edgemtp.runtime.bundle import MANIFEST

    folder = Path(bundle).resolve()
    manifest = folder / MANIFEST
    files = [p for p in folder.rglob("*") if p.is_file()]
    # a folder called "bundle" (as `edgemtp demo` caches it) is named by its parent
    name = folder.name if folder.name != "bundle" else f"{folder.parent.name}/bundle"
    out = {
        "path": str(bundle),
        "name": name,
        "sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
        "bytes": sum(p.stat().st_size for p in files),
        "backend": session_info.get("backend"),
        "delegate": session_info.get("delegate"),
        "quantization": session_info.get("quantization"),
        "max_context": session_info.get("shapes", {}).get("max_context"),
        "max_draft": session_info.get("shapes", {}).get("max_draft"),
    }
    if "kv_cache_bytes" in session_info:  # (an app's runtime reports none)
        out["kv_cache"] = {
            "dtype": session_info["kv_cache"],
            "bytes": session_info["kv_cache_bytes"],
        }
    return out


def result_document(
    command: str,
    machine: dict[str, Any],
    bundle: dict[str, Any],
    plan: BenchPlan,
    runs: list[dict],
    predictions: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "machine": machine,
        "bundle": bundle,
        "plan": {
            "pp": list(plan.pp),
            "tg": list(plan.tg),
            "depths": list(plan.depths),
            "repeat": plan.repeat,
            "tg_prompt": plan.tg_prompt,
            "acceptance_oracle": plan.acceptance_oracle,
            "seed": plan.seed,
            "sampling": "greedy",
        },
        "runs": runs,
        "summary": summarize(runs),
        "predictions": predictions,
    }

"""The apps' benchmark mode (`apps/core`'s `run_bench`) against `edgemtp bench`'s own
(`runtime/bench.py`).

`bench_test` (built here with CMake) runs the C++ `run_bench` over a deterministic fake target
and prints the result document. The same fake, written again in Python below, goes through
`runtime.bench.run_bench`: every run record (order, warm-ups, rounds, prompts and their hashes,
tokens, timings, validity, failures, skipped tests) must be the same. The document must also
validate against `runtime/bench.schema.json`, pass `bench_report.read_result`, and become a
report through `edgemtp bench collect` whose medians are recomputed here with `statistics`.
SHA-256 (and the SHA-512 that Python's `random.Random(str)` seeds with) are checked against
hashlib.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from edgemtp.cli import main
from edgemtp.errors import EdgeMTPError
from edgemtp.runtime import bench
from edgemtp.runtime.bench_report import check_result, read_result

# The plan both sides run: pp300 and tg250 do not fit a context of 256; call 5 (tg8's depth-1
# warm-up) and call 10 (tg8's round-1 AR run) fail; depth 2's last token differs from AR's.
PLAN = dict(pp=(16, 300), tg=(8, 250), depths=(0, 1, 2), repeat=3, tg_prompt=12, seed=5)
FAKE = dict(max_context=256, max_draft=3, vocab=500, stop_ids=(1, 2), has_drafter=True)
FAIL_CALLS = (5, 10)
MISMATCH_DEPTH = 2


# --- the fake target, as bench_test.cpp's FakeTarget -------------------------------------------


@dataclass
class FakeStep:
    kind: str
    drafted: int
    accepted: int


@dataclass
class FakeGeneration:
    tokens: list[int]
    t_first: float
    t_end: float
    steps: list[FakeStep]
    values: dict[str, Any]

    def metrics(self) -> dict[str, Any]:
        return self.values


@dataclass
class FakeBackend:
    max_context: int
    max_draft: int
    vocab_size: int
    has_drafter: bool


@dataclass
class FakeSession:
    backend: FakeBackend
    stop_ids: tuple[int, ...]
    fail_calls: tuple[int, ...] = ()
    mismatch_depth: int = -1
    tokenizer: None = None
    calls: int = 0
    fresh: bool = False
    prompts: list[list[int]] = field(default_factory=list)

    def reset(self) -> None:
        self.fresh = True

    def generate(
        self, prompt: list[int], n: int, *, mtp: int, params: Any, stop_ids: Any, **flags: Any
    ) -> FakeGeneration:
        call, vocab = self.calls, self.backend.vocab_size
        # at depth auto the fake drafts (call + round) % (max draft + 1), times itself as depth 1
        auto = mtp == bench.AUTO
        depth = 1 if auto else mtp
        self.calls += 1
        self.prompts.append(list(prompt))
        if not self.fresh:
            raise EdgeMTPError("fake: generate without a reset before it")
        self.fresh = False
        assert params == bench.GREEDY and stop_ids == () and flags == {"interruptible": False}
        if call in self.fail_calls:
            raise EdgeMTPError(f"fake runner: call {call} failed")
        tokens = [(sum(prompt) + 7 * i) % vocab for i in range(n)]
        if not auto and depth == self.mismatch_depth and n > 1:
            tokens[-1] = (tokens[-1] + 1) % vocab
        ttft = 0.001 * len(prompt) * (1 + 0.01 * (call % 7))
        decode_s = 0.01 * (n - 1) / (1 + 0.5 * depth) * (1 + 0.01 * (call % 5)) if n > 1 else 0.0
        rounds, remaining, r = [], n - 1, 0
        while remaining > 0:
            wanted = (call + r) % (self.backend.max_draft + 1) if auto else depth
            drafted = min(wanted, remaining - 1)
            accepted = (call + r) % (drafted + 1)
            rounds.append(FakeStep("decode", drafted, accepted))
            remaining -= accepted + 1
            r += 1
        values = {
            "ttft_s": ttft,
            "prefill_tok_s": len(prompt) / ttft,
            "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "decode_seconds_by_phase": {
                "target": decode_s * 0.6,
                "drafter": decode_s * 0.3 if depth > 0 else 0.0,
                "host": decode_s * 0.1,
            },
        }
        return FakeGeneration(tokens, 0.0, decode_s, rounds, values)


def fake_session(**changes: Any) -> FakeSession:
    fake = {**FAKE, **changes}
    backend = FakeBackend(
        fake["max_context"], fake["max_draft"], fake["vocab"], fake["has_drafter"]
    )
    return FakeSession(
        backend,
        tuple(fake["stop_ids"]),
        fail_calls=changes.get("fail_calls", ()),
        mismatch_depth=changes.get("mismatch_depth", -1),
    )


# --- running bench_test ------------------------------------------------------------------------


def _csv(values: Any) -> str:
    return ",".join(map(str, values))


def bench_args(plan: dict[str, Any], **fake: Any) -> list[str]:
    fake = {**FAKE, **fake}
    args = [
        "--pp", _csv(plan["pp"]), "--tg", _csv(plan["tg"]), "--depths", _csv(plan["depths"]),
        "--repeat", str(plan["repeat"]), "--tg-prompt", str(plan["tg_prompt"]),
        "--seed", str(plan["seed"]), "--max-context", str(fake["max_context"]),
        "--max-draft", str(fake["max_draft"]), "--vocab", str(fake["vocab"]),
        "--stop-ids", _csv(fake["stop_ids"]),
    ]  # fmt: skip
    if fake.get("fail_calls"):
        args += ["--fail-calls", _csv(fake["fail_calls"])]
    if "mismatch_depth" in fake:
        args += ["--mismatch-depth", str(fake["mismatch_depth"])]
    if not fake["has_drafter"]:
        args.append("--no-drafter")
    return args


def run_tool(tool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def tool(core_build) -> Path:
    return core_build / "bench_test"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A bundle-shaped folder: manifest.json, a nested file, a link to a file (counted) and a
    link to a folder (not followed), in a folder called "bundle" (named by its parent)."""
    folder = tmp_path_factory.mktemp("bundles") / "fake-model" / "bundle"
    (folder / "weights").mkdir(parents=True)
    manifest = {"schema_version": 1, "quantization": {"scheme": "q4_0"}, "note": "ünïcode"}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (folder / "weights" / "model.onnx").write_bytes(bytes(range(256)) * 40)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "link.onnx").symlink_to(folder / "weights" / "model.onnx")
    (folder / "link-dir").symlink_to(folder / "weights", target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def document(tool, bundle) -> dict[str, Any]:
    args = bench_args(PLAN, fail_calls=FAIL_CALLS, mismatch_depth=MISMATCH_DEPTH)
    done = run_tool(tool, "run", "--bundle", str(bundle), *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def python_runs(plan: dict[str, Any], **fake: Any) -> list[dict[str, Any]]:
    session = fake_session(**fake)
    runs = bench.run_bench(session, bench.BenchPlan(**plan), [], lambda _: None)
    return json.loads(json.dumps(runs))


def _close(value: Any) -> Any:
    """Numbers to 12 significant digits (the C++ side writes 17; the arithmetic is the same but
    may round its last bit differently), recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(f"{value:.12g}")
    if isinstance(value, list):
        return [_close(v) for v in value]
    return {k: _close(v) for k, v in value.items()}


def _order(runs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r["test"], "skipped")
        if "skipped" in r
        else (r["test"], r["depth"], r["round"], r["warmup"])
        for r in runs
    ]


# --- the tests ---------------------------------------------------------------------------------


def test_runs_equal_python_run_bench(document):
    expected = python_runs(PLAN, fail_calls=FAIL_CALLS, mismatch_depth=MISMATCH_DEPTH)
    assert _order(document["runs"]) == _order(expected)
    assert _close(document["runs"]) == _close(expected)


def test_run_order_and_semantics_as_documented(document):
    runs = document["runs"]
    pp = [("pp16", 0, -1, True)] + [("pp16", 0, r, False) for r in range(3)]
    tg = [("tg8", d, -1, True) for d in (0, 1, 2)]
    tg += [("tg8", d, r, False) for r in range(3) for d in (0, 1, 2)]
    assert _order(runs) == [*pp, ("pp300", "skipped"), *tg, ("tg250", "skipped")]
    assert [r["skipped"] for r in runs if "skipped" in r] == ["does not fit the context of 256"] * 2

    measured = [r for r in runs if "skipped" not in r]
    # calls 5 and 10 failed: their records carry the error and nothing measured
    failed = [i for i, r in enumerate(measured) if r["error"]]
    assert failed == list(FAIL_CALLS)
    for i in failed:
        assert measured[i]["error"] == f"fake runner: call {i} failed"
        assert "tokens" not in measured[i] and "valid" not in measured[i]
    # validity: null for AR, warm-ups and a round whose AR run failed; else MTP tokens == AR's
    valid = {(r["depth"], r["round"]): r.get("valid") for r in measured if r["test"] == "tg8"}
    assert [valid[d, -1] for d in (0, 2)] == [None, None]
    assert [valid[0, r] for r in range(3)] == [None] * 3
    assert [valid[1, r] for r in range(3)] == [True, None, True]
    assert [valid[2, r] for r in range(3)] == [False, None, False]
    # a round's depths share its prompt; every other run has a prompt of its own
    hashes = [(r["test"], r["round"], r["depth"], r["prompt_sha256"]) for r in measured]
    by_round = {}
    for test, round_, depth, sha in hashes:
        key = (test, round_) if round_ >= 0 else (test, round_, depth)
        by_round.setdefault(key, set()).add(sha)
    assert all(len(shas) == 1 for shas in by_round.values())
    assert len({next(iter(s)) for s in by_round.values()}) == len(by_round)
    for r in measured:
        assert r["prompt_tokens"] == (16 if r["test"] == "pp16" else 12)
        if not r["error"]:
            n = r["generated_tokens"]
            assert n == len(r["tokens"]) == (1 if r["test"] == "pp16" else 8)
            assert r["decode_tok_s"] == (pytest.approx((n - 1) / r["decode_s"]) if n > 1 else None)
            assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])
            assert sum(a + 1 for _, a in r["rounds"]) == n - 1


def test_depth_order_and_no_failures_equal_python(tool, bundle):
    # AR after MTP: the MTP run has no AR tokens to compare with yet (valid null)
    plan = dict(pp=(), tg=(5,), depths=(1, 0), repeat=2, tg_prompt=3, seed=0)
    done = run_tool(tool, "run", "--bundle", str(bundle), *bench_args(plan, vocab=7))
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert _close(runs) == _close(python_runs(plan, vocab=7))
    assert [r["valid"] for r in runs] == [None] * 6


def test_auto_depth_runs_equal_python(tool, bundle):
    """`--mtp auto` beside pinned depths: the same runs, prompts and records (depth "auto") as
    runtime/bench.py, and a document `bench collect` summarizes with the depths auto chose."""
    plan = dict(pp=(), tg=(9,), depths=(0, 2, "auto"), repeat=2, tg_prompt=6, seed=3)
    done = run_tool(tool, "run", "--bundle", str(bundle), *bench_args(plan))
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["plan"]["depths"] == [0, 2, "auto"]
    expected = python_runs(plan)
    assert _close(document["runs"]) == _close(expected)
    autos = [r for r in document["runs"] if r["depth"] == "auto"]
    assert len(autos) == 3 and {d for r in autos for d, _ in r["rounds"]} > {0, 1}
    jsonschema.Draft202012Validator(json.loads(bench.SCHEMA_FILE.read_text())).validate(document)
    (row,) = [r for r in check_result(document, "bench_test")["summary"] if r["depth"] == "auto"]
    chosen: dict[str, int] = {}
    for r in autos[1:]:  # the timed runs
        for drafted, _ in r["rounds"]:
            chosen[str(drafted)] = chosen.get(str(drafted), 0) + 1
    assert row["depths_used"] == chosen


def test_context_boundary_equal_python(tool, bundle):
    # prompt + generated + deepest draft + 1 must fit: pp30 and tg19 just do, pp31 and tg20 not
    plan = dict(pp=(30, 31), tg=(19, 20), depths=(0, 2), repeat=1, tg_prompt=10, seed=1)
    args = bench_args(plan, max_context=32)
    done = run_tool(tool, "run", "--bundle", str(bundle), *args)
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert _close(runs) == _close(python_runs(plan, max_context=32))
    assert [r["test"] for r in runs if "skipped" in r] == ["pp31", "tg20"]


def test_document_is_a_bench_result(document, bundle, tmp_path):
    schema = json.loads(bench.SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator(schema).validate(document)
    assert "summary" not in document  # collect computes it
    checked = check_result(json.loads(json.dumps(document)), "bench_test")
    assert checked["summary"] == bench.summarize(document["runs"])
    path = tmp_path / "phone.json"
    path.write_text(json.dumps(document))
    assert read_result(path)["runs"] == document["runs"]

    assert document["schema"] == bench.SCHEMA
    assert document["created"] == "2026-01-02T03:04:05Z"
    info = {
        "backend": "onnx",
        "delegate": "cpu",
        "quantization": "q4_0",
        "shapes": {"max_context": FAKE["max_context"], "max_draft": FAKE["max_draft"]},
    }
    assert document["bundle"] == bench.bundle_info(bundle, info)
    assert document["bundle"]["name"] == "fake-model/bundle"
    assert (
        document["bundle"]["sha256"]
        == hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    )
    python_doc = bench.result_document("x", {}, {}, bench.BenchPlan(**PLAN), [], None)
    assert document["plan"] == python_doc["plan"]
    assert document["machine"] == {
        "platform": "android", "device": "Fake Phone", "cpu": "fake cpu", "cores": 8,
        "memory_gib": 12, "os": "Android 16", "threads": 4,
        "libraries": {"executorch": "1.5.1", "onnxruntime": None},
    }  # fmt: skip


def test_collect_report_medians(document, tmp_path):
    (tmp_path / "from").mkdir()
    (tmp_path / "from" / "phone.json").write_text(json.dumps(document))
    out = tmp_path / "report"
    assert main(["bench", "collect", "--from", str(tmp_path / "from"), "--out", str(out)]) == 0
    assert (out / "bench.md").is_file()
    report = json.loads((out / "results" / "phone.json").read_text())
    rows = {(row["test"], row["depth"]): row for row in report["summary"]}
    assert sorted(rows) == [("pp16", 0), ("tg8", 0), ("tg8", 1), ("tg8", 2)]
    for (test, depth), row in rows.items():
        timed = [
            r
            for r in document["runs"]
            if r["test"] == test and r.get("depth") == depth and not r["warmup"]
        ]
        ok = [r for r in timed if r["error"] is None]
        speed = [r["prefill_tok_s" if test.startswith("pp") else "decode_tok_s"] for r in ok]
        assert row["tok_s_median"] == statistics.median(speed)
        assert row["ttft_ms_median"] == 1000 * statistics.median(r["ttft_s"] for r in ok)
        assert row["runs"] == len(timed) and row["failed"] == len(timed) - len(ok)
        checked = [r["valid"] for r in ok if r["valid"] is not None]
        assert row["checked_runs"] == len(checked)
    assert rows["tg8", 0]["failed"] == 1 and rows["tg8", 2]["valid_runs"] == 0


def test_stop_and_battery(tool, bundle):
    args = bench_args(PLAN, fail_calls=FAIL_CALLS)
    done = run_tool(tool, "run", "--bundle", str(bundle), *args, "--battery", "--stop-after", "7")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert _order(runs) == _order(python_runs(PLAN))[:8]  # 7 runs and pp300's skip
    for r in runs:
        if r.get("error") is None and "skipped" not in r:
            assert r["battery"]["source"] == "fake counter" and r["battery"]["unit"] == "uAh"
            # the fake reads 5000 - calls before a run, 4999.5 - calls after it (one call later)
            assert r["battery"]["end"] == r["battery"]["start"] - 1.5
            assert (r["battery"]["thermal_start"], r["battery"]["thermal_end"]) == (
                "nominal",
                "fair",
            )
        else:
            assert "battery" not in r
    assert done.stderr.splitlines()[-1] == "progress 7/16 tg8 round 1/3, depth 0"


@pytest.mark.parametrize(
    ("changes", "plan_changes"),
    [
        ({"max_draft": 1}, {}),
        ({"has_drafter": False}, {}),
        ({}, {"repeat": 0}),
        ({}, {"tg_prompt": 0}),
        ({}, {"depths": (-2, 0)}),
        ({"has_drafter": False}, {"depths": (0, "auto")}),
    ],
)
def test_plan_errors_as_python(tool, bundle, changes, plan_changes):
    plan = {**PLAN, **plan_changes}
    with pytest.raises(EdgeMTPError) as python_error:
        bench.BenchPlan(**plan).check(fake_session(**changes).backend)
    done = run_tool(tool, "run", "--bundle", str(bundle), *bench_args(plan, **changes))
    assert done.returncode == 2
    message = str(python_error.value).replace("(-2, 0)", "[-2, 0]")  # a tuple in Python
    assert done.stderr.strip() == f"error: {message}"


def test_unreadable_bundle(tool, tmp_path):
    done = run_tool(tool, "run", "--bundle", str(tmp_path), *bench_args(PLAN))
    assert done.returncode == 2 and "manifest.json: cannot read it" in done.stderr
    (tmp_path / "manifest.json").write_text('{"quantization": {}}')
    done = run_tool(tool, "run", "--bundle", str(tmp_path), *bench_args(PLAN))
    assert done.returncode == 2 and "no quantization.scheme" in done.stderr


@pytest.mark.parametrize(
    ("seed", "run", "length", "vocab", "stop"),
    [
        (0, "tg128 0", 64, 262144, (1, 106)),
        (5, "pp512 warm-up 0", 512, 500, (1, 2)),
        (12345678901, "tg8 2", 40, 7, (0, 6)),
        (3, "tg8 1", 10, 1, (0,)),  # no ordinary token: ids are 0
    ],
)
def test_prompts_equal_python_prompt_maker(tool, seed, run, length, vocab, stop):
    done = run_tool(tool, "prompt", str(seed), run, str(length), str(vocab), _csv(stop))
    assert done.returncode == 0, done.stderr
    ids_line, sha_line = done.stdout.splitlines()
    session = fake_session(vocab=vocab, stop_ids=stop)
    expected = bench.PromptMaker(session, [], seed).make(run, length)
    assert json.loads(ids_line) == expected
    assert sha_line == hashlib.sha256(str(expected).encode()).hexdigest()[:16]


def _inputs() -> dict[str, bytes]:
    rng = random.Random(0)
    sized = {f"{n} bytes": rng.randbytes(n) for n in (55, 56, 63, 64, 65)}
    sized.update({f"{n} bytes": b"a" * n for n in (111, 112, 119, 120, 127, 128, 129)})
    return {"empty": b"", "abc": b"abc", **sized, "1 MB": rng.randbytes(1 << 20)}


@pytest.mark.parametrize("name", list(_inputs()))
def test_sha256_and_sha512_equal_hashlib(tool, tmp_path, name):
    data = _inputs()[name]
    path = tmp_path / "input"
    path.write_bytes(data)
    done = run_tool(tool, "sha256", str(path))
    assert done.returncode == 0, done.stderr  # whole, in odd pieces and from the file agree
    assert done.stdout.strip() == hashlib.sha256(data).hexdigest()
    done = run_tool(tool, "sha512", str(path))
    assert done.stdout.strip() == hashlib.sha512(data).hexdigest()

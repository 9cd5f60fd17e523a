"""`edgemtp bench` and `bench collect` on a tiny ONNX bundle.

Oracles: the reference engine's greedy tokens for the very prompts the bench ran (the ONNX CPU
program computes the reference's numerics), arithmetic on the recorded timestamps and rounds
(medians with `statistics`, acceptance counted by hand), the JSON schema, and the acceptance
oracle's two ends (rate 1: every draft accepted; rate 0: none) on tokens that still equal AR's.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import jsonschema
import pytest

from edgemtp.cli import main
from edgemtp.quantize.load import load_target
from edgemtp.runtime.bench import (
    SCHEMA_FILE,
    BenchPlan,
    PromptMaker,
    acceptance_by_position,
    run_bench,
)
from edgemtp.runtime.generate import generate
from edgemtp.runtime.session import Session

TG, REPEAT, DEPTHS = 12, 2, (0, 1, 2, "auto")


@pytest.fixture(scope="module")
def pair(tiny_q4_0_pair) -> tuple[Path, Path]:
    return tiny_q4_0_pair


@pytest.fixture(scope="module")
def bundle(pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "tiny-onnx"
    assert main([
        "export", "--model", str(pair[0]), "--drafter", str(pair[1]), "--backend", "onnx",
        "--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8", "--out", str(out),
        "--activations", "fp32",  # the reference's numerics: its tokens are the oracle
    ]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "host.toml"
    assert main(["devices", "calibrate", "--threads", "1", "--quick", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def report(bundle, profile, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("report") / "bench"
    argv = ["bench", "--bundle", str(bundle), "--pp", "16,200", "--tg", str(TG),
            "--mtp", "auto,0,1,2", "--repeat", str(REPEAT), "--device", str(profile),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (result,) = (out / "results").glob("*.json")
    return out, json.loads(result.read_text())


def test_every_run_is_recorded_and_the_result_matches_the_schema(report):
    out, doc = report
    jsonschema.validate(doc, json.loads(SCHEMA_FILE.read_text()))
    runs = [r for r in doc["runs"] if "skipped" not in r]
    # pp16: a warm-up and REPEAT rounds at depth 0; tg: the same at each depth.
    assert len(runs) == (1 + REPEAT) * (1 + len(DEPTHS))
    assert sum(r["warmup"] for r in runs) == 1 + len(DEPTHS)
    assert [r for r in doc["runs"] if "skipped" in r] == [
        {"test": "pp200", "skipped": "does not fit the context of 96"}
    ]
    assert all(r["error"] is None for r in runs)
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance_by_position.png", "bench.md", "results", "time_by_phase.png",
        "tok_s_by_depth.png",
    ]  # fmt: skip
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(doc["bundle"]["sha256"]) == 64 and doc["machine"]["threads"] >= 1


def test_ar_and_mtp_tokens_equal_the_reference_engine_on_the_same_prompts(report, pair):
    _, doc = report
    target = load_target(pair[0])
    tg = [r for r in doc["runs"] if r["test"] == f"tg{TG}" and not r["warmup"]]
    by_round: dict[int, list[dict]] = {}
    for r in tg:
        by_round.setdefault(r["round"], []).append(r)
    assert sorted(by_round) == list(range(REPEAT))
    prompts = set()
    for round_runs in by_round.values():
        # identical inputs: every depth of a round ran the same prompt
        assert len({r["prompt_sha256"] for r in round_runs}) == 1
        prompts.add(round_runs[0]["prompt_sha256"])
        assert [r["depth"] for r in round_runs] == list(DEPTHS)  # interleaved
        ar = round_runs[0]
        for r in round_runs[1:]:
            assert r["valid"] is True and r["tokens"] == ar["tokens"]
        assert ar["valid"] is None and len(ar["tokens"]) == TG
    assert len(prompts) == REPEAT  # controlled-cold: a new prompt every round
    # The bench's prompt maker is deterministic: rebuild round 0's prompt and decode it with the
    # reference engine.
    session = Session.from_bundle(Path(doc["bundle"]["path"]), verify=False)
    prompt = PromptMaker(session, [], seed=0).make(f"tg{TG} 0", 32)
    reference = generate(target, prompt, TG).tokens
    assert by_round[0][0]["tokens"] == reference


def test_summary_is_the_median_of_the_timed_runs(report):
    _, doc = report
    for row in doc["summary"]:
        runs = [r for r in doc["runs"] if r.get("test") == row["test"]
                and r.get("depth") == row["depth"] and not r["warmup"]]  # fmt: skip
        assert row["runs"] == len(runs) == REPEAT
        key = "prefill_tok_s" if row["test"].startswith("pp") else "decode_tok_s"
        assert row["tok_s_median"] == pytest.approx(statistics.median(r[key] for r in runs))
        for r in runs:
            if key == "decode_tok_s":  # (n_out - 1) / (t_end - t_first)
                assert r[key] == pytest.approx((r["generated_tokens"] - 1) / r["decode_s"])
        rounds = [rd for r in runs for rd in r["rounds"]]
        drafted, accepted = (sum(x) for x in zip(*rounds, strict=True)) if rounds else (0, 0)
        if not drafted:  # AR, or an adaptive depth that chose AR throughout
            assert row["acceptance_rate"] is None
        else:
            assert row["acceptance_rate"] == pytest.approx(accepted / drafted)
            assert row["committed_per_round"] == pytest.approx(
                (len(rounds) + accepted) / len(rounds)
            )
    ar = {r["test"]: r for r in doc["summary"] if r["depth"] == 0}
    for row in doc["summary"]:
        assert row["vs_ar"] == pytest.approx(row["tok_s_median"] / ar[row["test"]]["tok_s_median"])


def test_each_row_has_the_simulators_prediction(report, capsys):
    _, doc = report
    predicted = {(p["test"], p["depth"]): p for p in doc["predictions"]["rows"]}
    assert set(predicted) == {(r["test"], r["depth"]) for r in doc["summary"]}
    for row in doc["summary"]:
        p = predicted[(row["test"], row["depth"])]
        assert p["tok_s"] > 0
        assert p["error"] == pytest.approx(p["tok_s"] / row["tok_s_median"] - 1)


def test_decode_prediction_is_the_median_over_runs_at_each_runs_acceptance(report, bundle, profile):
    # The row's measured speed is the median run's, so the prediction is the median of each run
    # predicted at its own acceptance. Here one run accepts every draft in 10 rounds and the
    # other none in 30: each alone commits 3 and 1 tokens per round (median of two: 2); pooling
    # the 40 rounds would predict 1 + 1/4 + 1/4 = 1.5.
    from edgemtp.devices.bench_prediction import predict_bench as predict
    from edgemtp.devices.profiles import load_profile
    from edgemtp.devices.simulator import Acceptance, model_from_bundle, simulate

    _, doc = report
    runs = [dict(r) for r in doc["runs"]]
    timed = [r for r in runs if r.get("depth") == 2 and r["test"] == f"tg{TG}" and not r["warmup"]]
    timed[0]["rounds"], timed[1]["rounds"] = [[2, 2]] * 10, [[2, 0]] * 30
    plan = BenchPlan(pp=(), tg=(TG,), depths=(0, 1, 2), repeat=REPEAT)
    rows = predict(bundle, str(profile), "cpu", plan, runs)["rows"]
    (mine,) = [p["tok_s"] for p in rows if p["test"] == f"tg{TG}" and p["depth"] == 2]
    model, device = model_from_bundle(bundle), load_profile(str(profile))
    each = [
        simulate(model, device, "cpu", (2,), Acceptance(rates, "by hand"), 32, TG).decode_tok_s[2]
        for rates in ((1.0, 1.0), (0.0, 0.0))
    ]
    assert mine == pytest.approx(statistics.median(each))
    pooled = simulate(model, device, "cpu", (2,), Acceptance((0.25, 1.0), "pooled"), 32, TG)
    assert mine > 1.2 * pooled.decode_tok_s[2]


def test_the_onnx_bundles_linear_kernels_are_priced_each(bundle, profile):
    """The simulator counts each method's MatMulNBits nodes (as the graphs hold them) and adds
    the profile's `linear_us` once per node to that method's call."""
    from dataclasses import replace

    import onnx

    from edgemtp.devices.profiles import load_profile
    from edgemtp.devices.simulator import Acceptance, model_from_bundle, simulate

    model, device = model_from_bundle(bundle), load_profile(str(profile))
    for method in ("verify_0", "draft_step", "prefill_final"):
        graph = onnx.load(bundle / "onnx" / f"{method}.onnx", load_external_data=False).graph
        nodes = sum(n.op_type == "MatMulNBits" for n in graph.node)
        assert model.linears[method] == nodes > 0, method
    cpu = device.delegates["cpu"]

    def verify_seconds(linear_us: float) -> float:
        onnx_numbers = {**cpu.backends["onnx"], "linear_us": linear_us}
        unit = replace(cpu, backends={"onnx": onnx_numbers})
        priced = replace(device, delegates={**device.delegates, "cpu": unit})
        out = simulate(model, priced, "cpu", (0,), Acceptance((0.5,), "by hand"), 32, TG)
        return out.terms["verify_0"].seconds

    added = verify_seconds(10.0) - verify_seconds(0.0)
    assert added == pytest.approx(model.linears["verify_0"] * 10e-6)


def test_simulate_on_a_bundle_compares_the_depths_it_verifies(bundle, profile, capsys):
    """Without --mtp, `edgemtp simulate --bundle` compares AR and every depth the bundle
    verifies (this one: 2), not a preset's 0-4 it cannot run."""
    argv = ["simulate", "--bundle", str(bundle), "--device", str(profile), "--delegate", "cpu",
            "--prompt", "32", "--gen", str(TG), "--json"]  # fmt: skip
    assert main(argv) == 0
    assert list(json.loads(capsys.readouterr().out)["decode_tok_s"]) == ["0", "1", "2"]
    assert main([*argv, "--mtp", "0,3"]) == 1
    assert "verifies at most 2 drafts" in capsys.readouterr().err


def test_auto_row_reports_the_depths_the_policy_chose(report):
    _, doc = report
    (row,) = [r for r in doc["summary"] if r["depth"] == "auto"]
    runs = [r for r in doc["runs"] if r.get("depth") == "auto" and not r["warmup"]]
    chosen: dict[str, int] = {}
    for r in runs:
        for drafted, _ in r["rounds"]:
            chosen[str(drafted)] = chosen.get(str(drafted), 0) + 1
    assert row["depths_used"] == chosen and set(chosen) <= {"0", "1", "2"}
    (pred,) = [p for p in doc["predictions"]["rows"] if p["depth"] == "auto"]
    assert pred["best_depth"] in (0, 1, 2)
    plain = [p for p in doc["predictions"]["rows"] if p["depth"] != "auto"]
    assert all("best_depth" not in p for p in plain)


def test_acceptance_by_position_counted_by_hand():
    # rounds (drafted, accepted). Position 1: all 5 rounds try it, 4 accept it. Position 2: the
    # 3 rounds that drafted 2+ and accepted draft 1 try it, 1 accepts it. Position 3: only
    # (3, 2) reaches it, and misses.
    rounds = [(3, 0), (3, 1), (3, 2), (2, 1), (1, 1)]
    assert acceptance_by_position(rounds) == [
        pytest.approx(4 / 5), pytest.approx(1 / 3), pytest.approx(0 / 1)
    ]  # fmt: skip
    assert acceptance_by_position([(0, 0)]) == []


@pytest.mark.parametrize(("rate", "accepted_all"), [(1.0, True), (0.0, False)])
def test_acceptance_oracle_controls_acceptance_and_keeps_ar_tokens(bundle, rate, accepted_all):
    session = Session.from_bundle(bundle, verify=False)
    plan = BenchPlan(pp=(), tg=(TG,), depths=(0, 2), repeat=1, acceptance_oracle=rate)
    drafter_calls = session.backend.calls
    runs = run_bench(session, plan, [], lambda _: None)
    timed = [r for r in runs if not r["warmup"]]
    ar, mtp = timed
    assert mtp["acceptance_oracle"] == rate and mtp["tokens"] == ar["tokens"]
    drafted = sum(k for k, _ in mtp["rounds"])
    accepted = sum(n for _, n in mtp["rounds"])
    assert drafted > 0
    assert (accepted == drafted) if accepted_all else (accepted == 0)
    assert (
        drafter_calls.get("draft_step", 0)
        + sum(n for m, n in drafter_calls.items() if m.startswith("draft_step_"))
        >= drafted
    )  # the real drafter ran for every draft


class VerifySplitsFromAR:
    """Wraps a backend: in a run that drafts, verify's greedy choice after each row becomes a
    function of that row's token and position alone, as in a program whose verify rows break
    near-ties unlike its one-row AR step. The MTP continuation then differs from AR's but
    depends on nothing else (not on which drafts were accepted)."""

    def __init__(self, inner):
        self.inner, self.drafting = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def truncate(self, length: int) -> bool:
        self.drafting = self.drafting and length > 0
        return self.inner.truncate(length)

    def draft_step(self, token, hidden, position):
        self.drafting = True
        return self.inner.draft_step(token, hidden, position)

    def draft_chain(self, token, hidden, position, depth):
        return None  # drafting is marked step by step

    def verify(self, ids, position):
        logits, hidden = self.inner.verify(ids, position)
        if self.drafting:
            logits = logits.clone()
            for row, token in enumerate(ids):
                logits[row, (31 * token + position + row) % self.inner.vocab_size] += 1e3
        return logits, hidden


def test_acceptance_oracle_replays_verify_tokens_where_they_split_from_ar(bundle):
    session = Session.from_bundle(bundle, verify=False)
    session.backend = VerifySplitsFromAR(session.backend)
    plan = BenchPlan(pp=(), tg=(TG,), depths=(0, 2), repeat=1, acceptance_oracle=1.0)
    ar, mtp = [r for r in run_bench(session, plan, [], lambda _: None) if not r["warmup"]]
    assert mtp["tokens"] != ar["tokens"] and mtp["valid"] is False
    drafted = sum(k for k, _ in mtp["rounds"])
    assert drafted > 0 and sum(n for _, n in mtp["rounds"]) == drafted
    assert mtp["oracle_passes"] == 2  # the AR replay split; its own tokens then held


def test_collect_merges_a_device_result_and_refuses_bad_files(report, tmp_path, capsys):
    _, doc = report
    phone = json.loads(json.dumps(doc))
    phone["machine"] = {"platform": "android", "device": "Pixel 10 Pro", "cpu": "Tensor G5",
                        "threads": 4, "os": "Android 16"}  # fmt: skip
    del phone["summary"], phone["predictions"]  # an app writes runs; collect summarizes
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    (pulled / "pixel.json").write_text(json.dumps(phone))
    out = tmp_path / "merged"
    shutil.copytree(Path(report[0]), out)
    capsys.readouterr()
    assert main(["bench", "collect", "--from", str(pulled), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Pixel 10 Pro" in printed and doc["machine"]["cpu"] in printed
    assert len(list((out / "results").glob("*.json"))) == 2
    merged = json.loads((out / "results" / "pixel.json").read_text())
    assert merged["summary"][0]["tok_s_median"] == pytest.approx(doc["summary"][0]["tok_s_median"])
    assert "Pixel 10 Pro" in (out / "bench.md").read_text()

    (pulled / "pixel.json").write_text('{"schema": "edgemtp-bench/1", "runs": []}')
    assert main(["bench", "collect", "--from", str(pulled), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgemtp bench collect: error:") and "pixel.json" in err
    assert "'created' is a required property" in err and "\n" not in err
    (pulled / "pixel.json").write_text("{not json")
    assert main(["bench", "collect", "--from", str(pulled), "--out", str(out)]) == 1
    assert "not JSON" in capsys.readouterr().err


def test_collect_over_adb_says_what_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no adb anywhere
    assert main(["bench", "collect", "--adb", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "adb is not on PATH" in err and "--from DIR" in err


def test_bench_refuses_a_depth_the_bundle_lacks(bundle, capsys):
    assert main(["bench", "--bundle", str(bundle), "--mtp", "0,5", "--device", "none"]) == 1
    assert "verifies at most 2 drafts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--bundle", str(bundle), "--mtp", "0,x", "--device", "none"])
    assert "give draft depths like 0,1,2,3" in capsys.readouterr().err

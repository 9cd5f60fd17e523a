"""The simulator's rates fitted to published figures: the data file, the fit against factors it
must recover, leave-one-out on the data file, and `edgemtp simulate` pricing with the fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from edgemtp.cli import main
from edgemtp.devices.fit import (
    FITTED,
    PUBLISHED,
    UNIT_CLASS,
    beyond_the_machine,
    fit,
    fitted_rates,
    leave_one_out,
    load_figures,
    load_fitted,
    parameters,
    plan_of,
    predict,
    usable,
)
from edgemtp.devices.profiles import load_profile
from edgemtp.devices.simulator import Acceptance, model_from_preset, simulate

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results" / "simulator_published.json"


def test_every_published_figure_quotes_its_number_and_states_its_conditions():
    raw = json.loads(PUBLISHED.read_text())
    figures = load_figures()
    assert len({f.id for f in figures}) == len(figures) == len(raw["figures"])
    for f in figures:
        assert f.source.startswith(("BRIEF §", "https://")), f.id
        assert f"{f.tok_s:g}" in f.source, f"{f.id}: {f.tok_s} is not in its quote"
        assert f.quantity in ("prefill", "decode") and f.delegate in UNIT_CLASS
        assert f.engine in ("litert-lm", "llama.cpp", "executorch", "coreml-port", "edgemtp")
        # a decode from an empty context (llama-bench's tg) has no prompt
        assert f.prompt > 0 or (f.quantity == "decode" and f.gen > 0), f.id
        assert f.chunk > 0 and isinstance(f.pruned, bool)
        assert f.assumed, f"{f.id}: say what the brief leaves open"
    for study in raw["mtp"]:
        assert study["source"].startswith(("BRIEF §", "https://"))


def test_the_fit_recovers_the_factors_that_made_synthetic_figures():
    """Figures computed by the model itself at known factors, under the data file's very
    conditions: the fit (without its prior at 1) finds those factors again."""
    figures, _ = usable(load_figures())
    known = {
        "all.bandwidth": 0.8, "all.dispatch": 0.5, "cpu.gemm": 0.3, "cpu.gemv": 0.05,
        "gpu.gemm": 0.6, "htp.gemm": 0.2, "htp.dispatch": 3.0, "engine.coreml-port": 1.2,
        "engine.llama.cpp": 1.5,
    }  # fmt: skip
    assert set(parameters(figures)) == set(known)
    synthetic = [replace(f, tok_s=predict(f, known)) for f in figures]
    result = fit(synthetic, prior_width=None)
    assert result.parameters == len(known) < result.figures == len(figures)
    for name, value in known.items():
        assert result.factors[name] == pytest.approx(value, rel=0.02), name
    assert result.rms_log_error < 1e-3


def test_leave_one_out_on_the_data_file_is_what_the_results_report():
    """Each figure predicted by a fit of all the others, with fewer factors than figures; the
    table in benchmarks/results comes out of exactly this."""
    figures, missing = usable(load_figures())
    left_out = {f.id: why for f, why in missing}  # reported, not predicted
    assert left_out["executorch-s25-cpu-decode"] == "no 'galaxy-s25' profile"
    assert "the bus peaks at 120" in left_out["litert-m4-gpu-decode"]
    assert "the unit peaks at 4.04" in left_out["litert-m4-gpu-prefill"]
    # a device profiled without the unit a figure ran on (the blog's GPUs: only their CPUs)
    assert left_out["llamacpp-i7-gpu-tg256"] == "the 'laptop-i7-10750h' profile has no gpu delegate"
    assert len(left_out) == 12
    held = leave_one_out(figures)
    recorded = {r["id"]: r for r in json.loads(RESULTS.read_text())["rows"]}
    assert [h.figure.id for h in held] == list(recorded)
    for h in held:
        assert h.fit.figures == len(figures) - 1 and h.fit.parameters < h.fit.figures
        assert h.predicted == pytest.approx(recorded[h.figure.id]["loo_tok_s"], rel=1e-3)
    # where two or more devices pin a factor, a held-out decode lands within the bar
    pinned = (
        "litert-s26u-cpu-decode",
        "litert-s26u-gpu-decode",
        "litert-rpi5-cpu-decode",
        "litert-m4-cpu-decode",
        "litert-iphone17pro-gpu-decode",
        "coreml-iphone17pro-decode",
        "litert-i7-cpu-decode",
        "llamacpp-i7-cpu-tg256",
        "llamacpp-d9000p-cpu-tg256-d4096",
    )
    for name in pinned:
        assert abs(next(h for h in held if h.figure.id == name).error) <= 0.25


def test_a_figure_the_profiled_machine_cannot_reach_is_left_out_with_the_reason():
    """A decode that would stream a step's bytes past the bus's theoretical peak, or a prefill
    past the unit's peak rate, was measured under other conditions than its own: reported,
    never fitted. The same figures at reachable speeds are kept."""
    s26 = next(f for f in load_figures() if f.id == "litert-s26u-gpu-decode")
    unit = load_profile(s26.device).delegates[s26.delegate]
    # at exactly the bus peak a step's bytes take 1 / tok_s seconds
    peak_tok_s = unit.peak_memory_bandwidth_gbs * 1e9 / plan_of(s26).verify[0].work.bytes
    assert beyond_the_machine(replace(s26, tok_s=0.95 * peak_tok_s)) is None
    too_fast = replace(s26, tok_s=1.05 * peak_tok_s)
    assert "the bus peaks at" in beyond_the_machine(too_fast)
    kept, left_out = usable([s26, too_fast])
    assert kept == [s26] and left_out[0][0] is too_fast
    prefill = next(f for f in load_figures() if f.id == "litert-s26u-gpu-prefill")
    assert beyond_the_machine(prefill) is None
    assert "the unit peaks at" in beyond_the_machine(replace(prefill, tok_s=50 * prefill.tok_s))


def test_the_stored_factors_are_the_fit_of_the_data_file():
    figures, _ = usable(load_figures())
    stored = load_fitted(FITTED)
    assert stored == pytest.approx(fit(figures).factors, rel=1e-3)


def test_simulate_prices_a_preset_with_the_fitted_rates_on_the_command_line(capsys):
    def run(*extra: str) -> dict:
        argv = ["simulate", "--preset", "e2b", "--device", "galaxy-s26-ultra", "--delegate",
                "gpu", "--mtp", "0", "--prompt", "1024", "--gen", "256", "--json"]  # fmt: skip
        argv += extra
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    litert, llama, profile = run(), run("--engine", "llama.cpp"), run("--engine", "profile")
    assert litert["assumptions"]["engine"].startswith("litert-lm")
    assert "fitted" in litert["assumptions"]["numbers"]
    factor = load_fitted(FITTED)["engine.llama.cpp"]
    assert litert["decode_tok_s"]["0"] / llama["decode_tok_s"]["0"] == pytest.approx(factor)
    assert profile["assumptions"]["engine"].startswith("the profile's numbers")
    # edgemtp's program (a static cache) at LiteRT-LM's rates, near LiteRT-LM's published 52
    assert litert["decode_tok_s"]["0"] == pytest.approx(52, rel=0.25)
    assert main(["simulate", "--preset", "e2b", "--device", "galaxy-s26-ultra", "--delegate",
                 "gpu", "--engine", "mlc"]) == 1  # fmt: skip
    assert "no fitted factor for engine 'mlc'" in capsys.readouterr().err


def test_a_decode_step_follows_its_bytes_and_mtp_gains_at_most_its_tokens():
    """On a memory-bound fitted unit E4B's step costs what its bytes say over E2B's; an MTP
    round at the study's 2.595 tokens a forward gains less than 2.595x, by the verify and
    drafts' cost over verify_0's."""
    device = load_profile("galaxy-s26-ultra")
    rates = fitted_rates(device, "gpu")
    steps = {}
    for preset in ("e2b", "e4b"):
        model = model_from_preset(preset, "q4_0", 2048, 128, 2, ())
        pred = simulate(model, device, "gpu", (0,), Acceptance((), "AR"), 1024, 256, rates)
        steps[preset] = pred.terms["verify_0"]
    ratio = steps["e4b"].seconds / steps["e2b"].seconds
    assert ratio == pytest.approx(steps["e4b"].bytes / steps["e2b"].bytes, rel=0.05)
    model = model_from_preset("e4b", "w4a16", 2048, 128, 2, ())
    a1 = 0.8
    a2 = (2.595 - 1 - a1) / a1  # 1 + a1 + a1 * a2 = 2.595
    pred = simulate(model, device, "gpu", (0, 2), Acceptance((a1, a2), "study"), 1024, 256, rates)
    speedup = pred.decode_tok_s[2] / pred.decode_tok_s[0]
    cost = pred.round_ms[2] / pred.round_ms[0]
    assert speedup == pytest.approx(2.595 / cost) and 1 < speedup < 2.595


def test_no_rates_where_nothing_was_fitted():
    iphone = load_profile("iphone-17-pro")
    assert fitted_rates(iphone, "npu") is None  # no published npu figure: the profile stands
    assert fitted_rates(iphone, "metal").engine_factor == 1.0
    assert fitted_rates(iphone, "metal", "coreml-port").engine_factor > 1.0

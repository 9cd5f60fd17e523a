"""The simulator's prediction beside each measurement of `edgemtp bench`."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgemtp.devices.profiles import load_profile
from edgemtp.devices.simulator import (
    Acceptance,
    acceptance_from_rounds,
    model_from_bundle,
    simulate,
)
from edgemtp.runtime.bench import AUTO, BenchPlan, summarize, timed_runs


def predict_bench(
    bundle: Path, device: str, delegate: str, plan: BenchPlan, runs: Sequence[dict]
) -> dict[str, Any]:
    """The simulator's tok/s for each summary row: prefill for pp rows; for tg rows the median
    over the row's runs of the decode speed at the acceptance per position each run had. For
    an auto row: the simulator's best depth at that acceptance (what a perfect depth choice
    would give; the median run's named in `best_depth`)."""
    profile = load_profile(device)
    model = model_from_bundle(bundle)
    predicted: list[dict[str, Any]] = []
    assumptions: dict[str, Any] = {}
    for row in summarize(runs):
        n, depth = int(row["test"][2:]), row["depth"]
        if row["test"].startswith("pp"):
            prediction = simulate(model, profile, delegate, (0,), Acceptance((), "AR"), n, 1)
            tok_s = prediction.prefill_tok_s
        else:
            # each run at the acceptance its own rounds had (an oracle's included), and the
            # median over runs, as the measured row: the simulator predicts speed at a given
            # acceptance, it does not predict acceptance. (Pooling the rounds instead predicts
            # the speed at the mean acceptance, above the median run's when prompts differ.)
            candidates = tuple(range(model.max_draft + 1)) if depth == AUTO else (depth,)
            per_run = []
            for r in timed_runs(runs, row["test"], depth) or [{"rounds": []}]:
                source = f"measured in this bench: {row['test']} depth {depth}"
                acceptance = acceptance_from_rounds(r["rounds"], source)
                prediction = simulate(
                    model, profile, delegate, candidates, acceptance, plan.tg_prompt, n
                )
                per_run.append((prediction.decode_tok_s[prediction.best_depth], prediction))
            tok_s = statistics.median(t for t, _ in per_run)
            prediction = sorted(per_run, key=lambda p: p[0])[(len(per_run) - 1) // 2][1]
        assumptions = prediction.assumptions
        measured_tok_s = row["tok_s_median"]
        predicted.append(
            {
                "test": row["test"],
                "depth": depth,
                "tok_s": tok_s,
                "error": tok_s / measured_tok_s - 1 if measured_tok_s else None,
            }
        )
        if depth == AUTO:
            predicted[-1]["best_depth"] = prediction.best_depth
    return {
        "device": device,
        "profile": profile.name,
        "delegate": delegate,
        "profile_threads": profile.delegates[delegate].threads,
        "rows": predicted,
        "assumptions": {k: v for k, v in assumptions.items() if k != "acceptance"},
    }

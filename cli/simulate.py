"""`edgemtp simulate`: speed, energy and memory of a bundle or preset on a device profile."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from edgemtp.cli.common import check_positive
from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import KV_CACHE_KINDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict speed, energy and memory of a bundle or preset on a device profile",
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--bundle", type=Path, help="an export bundle")
    model.add_argument("--preset", help="a full-size preset: e2b, e4b (with its assistant)")
    p.add_argument("--quant", choices=("q4_0", "w4a16"), default="q4_0", help="with --preset")
    p.add_argument("--max-context", type=int, default=4096, help="with --preset")
    p.add_argument("--prefill-chunk", type=int, default=128, help="with --preset")
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_KINDS,
        help="with --preset: the KV cache's dtype (default fp32; a bundle's is its own)",
    )
    p.add_argument("--device", required=True, help="a device profile name or .toml file")
    p.add_argument("--delegate", required=True, choices=("cpu", "gpu", "metal", "npu", "htp"))
    p.add_argument(
        "--mtp",
        help="draft depths to compare (0: AR; default: every depth a --bundle verifies, "
        "0-4 for a --preset)",
    )
    p.add_argument(
        "--acceptance",
        default="0.6:0.9",
        help="MEAN[:DECAY] (draft 1 accepted with MEAN, each later position DECAY times the "
        "one before) or an `edgemtp generate --json` output whose trace gives them",
    )
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--gen", type=int, default=128, help="generated tokens")
    p.add_argument(
        "--engine",
        help="price with the rates fitted to published figures (devices/fitted.json) as this "
        "engine achieves them: litert-lm, llama.cpp, coreml-port; 'profile': the profile's own "
        "numbers (default: litert-lm for a --preset where the delegate is fitted, else profile)",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as one JSON object")


def _acceptance(text: str, depth: int) -> Any:
    from edgemtp.devices.simulator import mean_acceptance, trace_acceptance

    path = Path(text)
    if path.is_file():
        return trace_acceptance(path)
    mean, _, decay = text.partition(":")
    try:
        return mean_acceptance(float(mean), float(decay or 1.0), depth)
    except ValueError:
        raise EdgeMTPError(
            f"--acceptance {text!r}: give MEAN[:DECAY] (e.g. 0.6:0.9) or a trace file"
        ) from None


def run(args: argparse.Namespace) -> int:
    from edgemtp.devices.fit import REFERENCE_ENGINE, fitted_rates
    from edgemtp.devices.profiles import load_profile
    from edgemtp.devices.simulator import model_from_bundle, model_from_preset, simulate
    from edgemtp.model.cache import KV_CACHE_DTYPES
    from edgemtp.model.static import auto_context_buckets

    try:
        depths = tuple(sorted({int(d) for d in (args.mtp or "0").split(",")}))
    except ValueError:
        raise EdgeMTPError(f"--mtp {args.mtp!r}: give draft depths like 0,1,2,3") from None
    for flag, value in (("--prompt", args.prompt), ("--gen", args.gen)):
        check_positive(flag, value)
    device = load_profile(args.device)
    if args.bundle is not None and args.kv_cache is not None:
        raise EdgeMTPError("--kv-cache is for --preset; a bundle's cache is its own")
    if args.bundle is not None:
        model = model_from_bundle(args.bundle)
        if args.mtp is None and model.drafter is not None:
            depths = tuple(range(max(model.verify_depths, default=4) + 1))
    else:
        if args.mtp is None:
            depths = (0, 1, 2, 3, 4)
        cpu = args.delegate == "cpu"
        buckets = auto_context_buckets(args.max_context) if cpu else ()
        model = model_from_preset(
            args.preset, args.quant, args.max_context, args.prefill_chunk, max(depths), buckets
        )
        if args.kv_cache is not None:
            itemsize = KV_CACHE_DTYPES[args.kv_cache].itemsize
            model = replace(model, cache_itemsize=itemsize)
    rates = None
    engine = args.engine or ("profile" if args.bundle is not None else REFERENCE_ENGINE)
    if engine != "profile" and args.delegate in device.delegates:
        rates = fitted_rates(device, args.delegate, engine)
    result = simulate(
        model,
        device,
        args.delegate,
        depths,
        _acceptance(args.acceptance, max(depths)),
        args.prompt,
        args.gen,
        rates,
    )
    if args.json:
        print(json.dumps(result.as_json()))
        return 0
    a = result.assumptions
    print(f"{a['model']} on {a['device']}, {a['delegate']}")
    print(
        f"prefill {args.prompt} tokens: {result.prefill_tok_s:.0f} tok/s, "
        f"TTFT {result.ttft_s * 1000:.0f} ms"
    )
    print("depth  tokens/round  round ms  decode tok/s")
    for k, rate in result.decode_tok_s.items():
        mark = "  <- best" if k == result.best_depth else ""
        print(
            f"{k:5d}  {result.expected_tokens[k]:12.2f}  {result.round_ms[k]:8.2f}  "
            f"{rate:12.1f}{mark}"
        )
    battery = result.battery_pct_per_1k_tokens
    print(
        f"energy {result.energy_j_per_token:.3f} J/token"
        + (f", {battery:.2f} % battery per 1000 tokens" if battery is not None else "")
        + f"; peak memory {result.peak_memory_mb:.0f} MB"
    )
    print(
        f"assumptions: {a['numbers']}; {a['compute_dtype']} compute, {a['dispatch']}, "
        f"{a['launches']}; "
        f"acceptance {a['acceptance']}; {len(a['estimated_profile_numbers'])} profile "
        "numbers are estimates (--json lists them)"
    )
    return 0

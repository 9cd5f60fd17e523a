"""Spike: lower the static methods to one ExecuTorch .pte (XNNPACK, fp32), check it against the
reference engine, and time a verify call (k=0 is AR decode).

    python -m edgemtp.export.spike_executorch --preset tiny --out /tmp/spike
    python -m edgemtp.export.spike_executorch --preset e2b --scale 0.25 --only verify_0 --out ...

Prints one JSON object: lowering seconds, .pte bytes, greedy token equality (AR and MTP depth 2)
with the largest output differences seen per method, and the per-call median of `verify_0`.
Lowering takes minutes (torch.export + XNNPACK preprocessing per method), hence not a unit test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from edgemtp.export.driver import EagerRunner, ExecuTorchRunner, Runner, StaticDriver
from edgemtp.export.lower import export_methods, lower_to_executorch
from edgemtp.export.static import StaticBundle, StaticShapes
from edgemtp.model.checkpoint import load_drafter, load_target
from edgemtp.model.synth import write_preset
from edgemtp.runtime.generate import generate


class Compare:
    """Runs every call on two runners, records the largest float difference per output, and
    returns the second runner's results (so the second runner drives the decoding)."""

    def __init__(self, reference: Runner, tested: Runner):
        self.reference, self.tested, self.shapes = reference, tested, tested.shapes
        self.worst: dict[str, float] = {}
        self.int_mismatch: dict[str, int] = {}

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        a = self.reference.call(method, *inputs)
        b = self.tested.call(method, *inputs)
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            key = f"{method}[{i}]"
            if u.dtype.is_floating_point:
                self.worst[key] = max(self.worst.get(key, 0.0), float((u - v).abs().max()))
            elif not torch.equal(u, v):
                self.int_mismatch[key] = self.int_mismatch.get(key, 0) + 1
        return b


def time_method(runner: Runner, method: str, inputs: tuple[Tensor, ...], n: int = 30) -> float:
    """Median milliseconds per call (after 3 warm-up calls)."""
    for _ in range(3):
        runner.call(method, *inputs)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        runner.call(method, *inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=None, help="comma-separated methods (skips token checks)")
    ap.add_argument("--max-context", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    tdir, adir = args.out / args.preset, args.out / f"{args.preset}-assistant"
    if not tdir.exists():
        write_preset(args.preset, tdir, scale=args.scale, init_std=0.05)
    if not adir.exists() and args.only is None:
        write_preset(f"{args.preset}-assistant", adir, scale=args.scale, init_std=0.05)
    with_drafter = args.only is None
    ref_t = load_target(tdir)
    ref_d = load_drafter(adir, ref_t.cfg) if with_drafter else None
    t = load_target(tdir)
    d = load_drafter(adir, t.cfg) if with_drafter else None
    shapes = StaticShapes(args.max_context, 2 if with_drafter else 0, args.chunk)
    bundle = StaticBundle.build(t.model, d.model if d else None, shapes)
    report: dict[str, Any] = {"preset": args.preset, "scale": args.scale, "shapes": vars(args)}
    report["shapes"] = {"max_context": shapes.max_context, "chunk": shapes.chunk}
    only = tuple(args.only.split(",")) if args.only else None
    t0 = time.perf_counter()
    programs = export_methods(bundle, only)
    report["export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = lower_to_executorch(programs)
    report["lower_s"] = time.perf_counter() - t0
    pte = args.out / f"{args.preset}.pte"
    pte.write_bytes(data)
    report["pte_bytes"] = len(data)
    report["weight_bytes_fp32"] = 4 * sum(p.numel() for p in bundle.target.parameters()) + (
        4 * sum(p.numel() for p in bundle.drafter.parameters()) if bundle.drafter else 0
    )
    et = ExecuTorchRunner(pte, shapes)
    if with_drafter:
        prompt = torch.randint(3, ref_t.cfg.vocab_size, (21,), generator=torch.Generator())
        prompt = prompt.tolist()
        compare = Compare(EagerRunner(bundle), et)
        driver = StaticDriver(compare, t.tables)
        for depth in (0, 2):
            ref = generate(
                ref_t, prompt, args.new_tokens, drafter=ref_d, mtp_depth=depth, prefill_chunk=8
            )
            got = driver.generate(prompt, args.new_tokens, depth)
            report[f"tokens_equal_depth{depth}"] = got.tokens == ref.tokens
        report["max_abs_diff_eager_vs_et"] = compare.worst
        report["int_mismatches"] = compare.int_mismatch
    h, layers = t.cfg.hidden_size, t.cfg.num_layers
    ple = max(t.cfg.hidden_size_per_layer_input, 1)
    inputs = (torch.randn(1, h), torch.randn(1, layers, ple), torch.tensor([5]))
    report["verify_0_ms"] = time_method(et, "verify_0", inputs)
    report["verify_0_eager_ms"] = time_method(EagerRunner(bundle), "verify_0", inputs)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""Check a Core ML bundle of any size against the checkpoints it was exported from, holding one
linear at a time: what "converted and validated" can mean on a host without Core ML.

    python benchmarks/coreml_check.py --bundle BUNDLE --model Q4_0_TARGET --drafter Q4_0_DRAFTER
        [--out benchmarks/results/coreml_check_NAME]

- the package as the export's own check reads it (`validate_mlpackage`: an iOS 18 ML program,
  its functions with their inputs, outputs and states, the same states in every function, op
  counts and compute dtypes, the stored blobs);
- every linear weight stored in it, read back from weight.bin (`iter_package_weights`) and
  compared with the checkpoint's: int4 codes, offsets and fp16 scales equal to the stored 4-bit
  form (Q4_0: signed codes, no offset), fp16 weights equal to the float weights rounded to fp16;
  and every linear of the models stored (none missing, none twice);
- the package's bytes against one copy of the weights.

The checkpoints are the 4-bit ones the export read (`edgemtp quantize` reproduces them: the
quantizer is deterministic). Numerics of the program are checked on tiny models by
tests/test_export_coreml.py (`TorchCoreMLRunner`); running it needs macOS 15+.
Writes OUT.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS, command_line, log, machine, write_results
from torch import nn

from edgemtp.export.weights import attach_int4, int4_of
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.runners.coreml import iter_package_weights, validate_mlpackage


def expected_linears(model: Path, drafter: Path) -> dict[str, nn.Module]:
    """Every linear of the pair by its name in the package (`target_layers_0_..._q_proj`)."""
    target = load_target(model, float_4bit=False)
    assistant = load_drafter(drafter, target.cfg)
    attach_int4(target.model, target.source, target.names)
    attach_int4(assistant.model, assistant.source, assistant.names)
    return {
        f"{prefix}_{path}".replace(".", "_"): m
        for prefix, root in (("target", target.model), ("drafter", assistant.model))
        for path, m in root.named_modules()
        if isinstance(m, nn.Linear)
    }


def compare(entry: dict[str, np.ndarray | None], linear: nn.Module) -> tuple[str, int, bool]:
    """(kind, elements, equal) of one stored weight against its linear."""
    w = int4_of(linear)
    if w is None:
        stored = entry.get("value")
        expected = linear.weight.detach().half().numpy()
        return "fp16", expected.size, stored is not None and np.array_equal(stored, expected)
    data, scale, offset = entry.get("data"), entry.get("scale"), entry.get("offset")
    if data is None or scale is None:
        return w.scheme, w.codes.numel(), False
    ok = scale.dtype == np.float16 and np.array_equal(scale.astype(np.float32), w.scales.numpy())
    if w.symmetric:
        ok = ok and offset is None and np.array_equal(data, w.signed_codes().numpy())
    else:
        ok = ok and offset is not None and np.array_equal(data, w.codes.numpy())
        ok = ok and np.array_equal(offset, w.zeros.numpy())
    return w.scheme, w.codes.numel(), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="a Core ML bundle folder")
    ap.add_argument("--model", type=Path, required=True, help="the 4-bit target checkpoint")
    ap.add_argument("--drafter", type=Path, required=True, help="the 4-bit drafter checkpoint")
    ap.add_argument("--out", type=Path, help="results stem (default results/coreml_check_NAME)")
    args = ap.parse_args()
    package = args.bundle / "model.mlpackage"
    stem = args.out or RESULTS / f"coreml_check_{args.bundle.name}"
    start = time.perf_counter()
    report = validate_mlpackage(package)
    log(f"package: {len(report['functions'])} functions, {report['weight_bytes'] / 2**30:.2f} GiB")
    expected = expected_linears(args.model, args.drafter)
    checked: dict[str, dict[str, int]] = {}
    mismatched: list[str] = []
    unknown: list[str] = []
    one_copy = 0
    with torch.no_grad():
        for i, (key, entry) in enumerate(iter_package_weights(package)):
            linear = expected.pop(key, None)
            if linear is None:
                unknown.append(key)
                continue
            kind, elements, ok = compare(entry, linear)
            row = checked.setdefault(kind, {"linears": 0, "elements": 0})
            row["linears"] += 1
            row["elements"] += elements
            one_copy += elements * 2 if kind == "fp16" else elements // 2 + elements // 32 * 2
            if not ok:
                mismatched.append(key)
            if i % 50 == 0:
                log(f"{i + 1} linears checked, {len(mismatched)} differ")
    result = {
        "date": datetime.date.today().isoformat(),
        "command": command_line("coreml_check.py"),
        "machine": machine(),
        "bundle": str(args.bundle),
        "package": {k: v for k, v in report.items() if k != "functions"},
        "functions": {
            name: {
                "inputs": len(f["inputs"]),
                "outputs": len(f["outputs"]),
                "states": len(f["states"]),
                "ops": sum(f["ops"].values()),
                "int4_ops": f["ops"].get("constexpr_blockwise_shift_scale", 0),
            }
            for name, f in report["functions"].items()
        },
        "checked": checked,
        "mismatched": mismatched,
        "missing": sorted(expected),
        "unknown": unknown,
        "one_copy_bytes": one_copy,
        "seconds": round(time.perf_counter() - start, 1),
    }
    ok = not mismatched and not expected and not unknown
    lines = [
        f"# Core ML package check: `{args.bundle.name}`",
        "",
        f"`{result['command']}` ({result['date']}, {result['seconds']} s). "
        + ("Every stored weight equals the checkpoint's." if ok else "**MISMATCHES**."),
        "",
        "| function | inputs | outputs | states | ops | int4 constexprs |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {n} | {f['inputs']} | {f['outputs']} | {f['states']} | {f['ops']} | "
            f"{f['int4_ops']} |"
            for n, f in result["functions"].items()
        ),
        "",
        "| stored as | linears | elements | equal to the checkpoint |",
        "|---|---:|---:|---|",
        *(
            f"| {k} | {v['linears']} | {v['elements'] / 1e6:.0f} M | "
            f"{'all' if ok else 'see json'} |"
            for k, v in checked.items()
        ),
        "",
        f"Spec version {report['specification_version']}, opset {', '.join(report['opset'])}; "
        f"every function declares the same states: {report['shared_states']}. weight.bin "
        f"{report['weight_bytes'] / 2**30:.3f} GiB for one copy of the linears' weights "
        f"{one_copy / 2**30:.3f} GiB (the rest: norms, RoPE frequencies, 64-byte blob headers). "
        f"Missing linears: {len(expected)}; names not in the models: {len(unknown)}.",
        "",
    ]
    write_results(stem, result, "\n".join(lines))
    log(f"wrote {stem}.json/.md: {'ok' if ok else 'MISMATCHES'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

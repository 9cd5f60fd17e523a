"""`edgemtp` command line: generate, synth, quantize, quantize-report, export, distill,
train-target, demo, simulate, devices."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgemtp.errors import EdgeMTPError

if TYPE_CHECKING:
    from edgemtp.model.config import TextConfig


def _ids(text: str) -> list[int]:
    """Token ids separated by commas or spaces (argparse reports what it raises)."""
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text[:80]}' is not token ids (integers separated by commas or spaces)"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _mtp(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected auto or a depth (0 = AR)") from None
    if depth < 0:
        raise argparse.ArgumentTypeError(f"--mtp must be auto or >= 0, got {depth}")
    return depth


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from an export bundle or a checkpoint (reference CPU)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="export bundle folder (edgemtp export)")
    src.add_argument("--model", type=Path, help="target checkpoint folder: the reference engine")
    p.add_argument("--drafter", type=Path, help="MTP assistant checkpoint folder (with --model)")
    p.add_argument(
        "--delegate",
        choices=["cpu", "metal", "npu", "htp"],
        help="run a bundle on another delegate than it was exported for, where its backend can "
        "(ONNX htp bundle on the CPU EP; Core ML compute units)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the tokenizer.json of the model)")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 2,651,1234")
    p.add_argument("--max-new-tokens", type=int, required=True, help="committed tokens to make")
    p.add_argument(
        "--mtp",
        type=_mtp,
        default="auto",
        help="draft depth: auto (default; the fastest depth as measured while running, 0 "
        "without a drafter) or a pinned depth (0 = plain AR)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token(s)")
    p.add_argument("--no-prune", action="store_true", help="no prefill pruning (A/B; --model)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="rows per prefill (--model)")
    p.add_argument("--max-context", type=int, help="reference cache size (--model; default 4096)")
    p.add_argument(
        "--max-draft", type=int, default=4, help="deepest draft for --mtp auto (--model)"
    )
    p.add_argument("--chat", action="store_true", help="apply Gemma's chat turn format")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 check of the bundle's files (for repeated loads of one bundle)",
    )
    p.add_argument("--battery-wh", type=float, help="battery capacity, for battery %% per 1k")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument(
        "--threads",
        type=int,
        help="compute threads (torch, XNNPACK or ORT; default: 1 for small models, where "
        "waking a thread pool costs more than it saves and collapses on a busy machine; all "
        "cores otherwise)",
    )


def _add_synth(sub: argparse._SubParsersAction) -> None:
    from edgemtp.model.synth import PRESETS

    p = sub.add_parser("synth", help="write a random-weight checkpoint with real Gemma 4 shapes")
    p.add_argument("--preset", required=True, choices=PRESETS)
    p.add_argument("--scale", type=float, default=1.0, help="shrink width and depth (0 < F <= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="quantize a float target or drafter checkpoint to Q4_0 or W4A16"
    )
    p.add_argument("--model", required=True, type=Path, help="float checkpoint folder (HF layout)")
    p.add_argument("--scheme", required=True, choices=["q4_0", "w4a16"])
    p.add_argument("--group", type=int, help="w4a16 group size (default 128; q4_0 is 32)")
    p.add_argument("--asymmetric", action="store_true", help="w4a16 with zero points")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"], help="w4a16 rounding")
    p.add_argument("--calib", type=Path, help="calibration text for --method gptq")
    p.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens to use")
    p.add_argument(
        "--embeddings",
        default="q4_0",
        choices=["q4_0", "int8", "fp16"],
        help="token table (and tied LM head); default q4_0",
    )
    p.add_argument(
        "--ple",
        default="int8",
        choices=["q4_0", "int8", "fp16"],
        help="per-layer embedding table; default int8",
    )
    p.add_argument("--scale-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
    p.add_argument("--report", type=Path, metavar="TEXT", help="then run quantize-report on TEXT")
    p.add_argument("--drafter", type=Path, help="float drafter, for the report's MTP acceptance")


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize-report", help="what quantization cost, on a text file")
    p.add_argument("--model", required=True, type=Path, help="float target checkpoint")
    p.add_argument("--quantized", required=True, type=Path, help="quantized target (any format)")
    p.add_argument(
        "--text",
        type=Path,
        required=True,
        help="text (with the model's tokenizer.json) or, for models without one, token ids",
    )
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score")
    p.add_argument("--drafter", type=Path, help="float drafter (MTP acceptance before)")
    p.add_argument("--quantized-drafter", type=Path, help="quantized drafter (after)")
    p.add_argument("--out", type=Path, help="write OUT.json, OUT.txt and OUT.png")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="lower a target (+ MTP drafter) to an ExecuTorch, Core ML or ONNX bundle"
    )
    p.add_argument(
        "--model", required=True, type=Path, help="target: HF folder, quantized folder or .gguf"
    )
    p.add_argument("--drafter", type=Path, help="MTP assistant (without: AR-only bundle)")
    p.add_argument(
        "--quant",
        default="auto",
        choices=["auto", "none", "q4_0", "w4a16"],
        help="4-bit scheme (float checkpoints are quantized first, group 32); auto = as stored",
    )
    p.add_argument("--backend", required=True, choices=["executorch", "coreml", "onnx"])
    p.add_argument("--delegate", default="cpu", choices=["cpu", "metal", "npu", "htp"])
    p.add_argument("--max-context", type=int, default=4096, help="tokens the cache holds")
    p.add_argument(
        "--draft-depth",
        type=int,
        help="most drafts verified at once (default 3 with --drafter; 0 without: an AR-only "
        "bundle has no verify rounds to build)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, help="rows per prefill call (default 128, at most the ring)"
    )
    p.add_argument(
        "--context-buckets",
        default="auto",
        help="cache lengths with their own prefill and decode methods that read only that "
        "many slots "
        "(ExecuTorch cpu): comma-separated, 'none', or 'auto' = 512, 2048, ... below "
        "--max-context",
    )
    p.add_argument(
        "--activations",
        choices=("int8", "fp32"),
        help="ONNX cpu: what the 4-bit linears multiply; int8 (default, as XNNPACK's 8da4w: "
        "1.3-2x faster decode) or fp32 (the reference engine's numerics)",
    )
    p.add_argument(
        "--attention",
        choices=("kernel", "matmul"),
        help="ExecuTorch cpu: decode, verify and draft steps in edgemtp's kernels (default: "
        "attention reads only the cache slots attended, Q4_0 linears run as llama.cpp does; "
        "the runtime compiles them, the apps link them) or in XNNPACK alone (attention as "
        "batched matmuls over every slot; any stock ExecuTorch runtime)",
    )
    p.add_argument("--out", required=True, type=Path, help="bundle folder to create")
    p.add_argument("--force", action="store_true", help="replace an existing bundle at --out")


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from edgemtp.train.distill import add_arguments

    add_arguments(
        sub.add_parser(
            "distill", help="train an MTP assistant for any Gemma 4 target from its own outputs"
        )
    )


def run_distill(args: argparse.Namespace) -> int:
    import shlex

    from edgemtp.train.distill import run_distill as distill

    return distill(args, "edgemtp " + shlex.join(sys.argv[1:]))


def _add_train_target(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-target",
        help="pre-train the embedded Gemma 4 target on this CPU (edgemtp train-target --help)",
        add_help=False,
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)  # parsed by train/pretrain.py


def run_train_target(argv: list[str]) -> int:
    from edgemtp.train.pretrain import main as pretrain

    return pretrain(argv)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="export the embedded pair (first run) and compare MTP with AR on it"
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--tokens", type=int, default=128, help="tokens per run")
    p.add_argument("--repeat", type=int, default=5, help="runs of each prompt (median)")
    p.add_argument("--depth", type=int, default=3, help="MTP depth")
    p.add_argument("--out", type=Path, help="bundle folder (default: a cache under ~/.cache)")
    p.add_argument("--target", type=Path, help=argparse.SUPPRESS)  # another pair (tests)
    p.add_argument("--drafter", type=Path, help=argparse.SUPPRESS)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--json", action="store_true", help="print the prediction as one JSON object")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure a bundle: prefill and decode tok/s by draft depth, llama-bench style "
        "(`edgemtp bench collect` merges results from devices)",
    )
    p.add_argument("--bundle", type=Path, required=True, help="an export bundle")
    p.add_argument("--delegate", choices=("cpu", "metal", "npu", "htp"), help="as for generate")
    p.add_argument("--pp", type=_counts, default=(128, 512, 2048), help="prompt lengths: ppN tests")
    p.add_argument("--tg", type=_counts, default=(128,), help="generated lengths: tgN tests")
    p.add_argument(
        "--mtp",
        type=_bench_depths,
        help="draft depths, 0 = AR, auto = the adaptive depth (default: every depth the bundle "
        "has)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per test (median)")
    p.add_argument("--tg-prompt", type=int, default=32, help="prompt tokens before a tg test")
    p.add_argument(
        "--prompts",
        type=Path,
        help="prompt texts: a JSON list, or text with blank lines between prompts (default: the "
        "embedded model's held-out prompts)",
    )
    p.add_argument(
        "--acceptance-oracle",
        type=float,
        metavar="RATE",
        help="MTP rounds draft the AR run's own tokens, each kept with probability RATE (the "
        "drafter still runs): mechanics at a controlled acceptance, labelled as such",
    )
    p.add_argument(
        "--device",
        help="device profile for the simulator's prediction beside each row (default: host, "
        "once `edgemtp devices calibrate` wrote it; none: no prediction)",
    )
    p.add_argument("--threads", type=int, help="compute threads (default: as generate)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and oracle draws")
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of files")
    p.add_argument("--out", type=Path, default=Path("bench"), help="report folder (bench/)")

    c = sub.add_parser(
        "bench-collect",
        prog="edgemtp bench collect",
        help="`edgemtp bench collect`: merge bench results from a device or folder into a report",
    )
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--from", dest="folder", type=Path, help="a folder of result files")
    where.add_argument("--adb", action="store_true", help="pull the Android app's results")
    c.add_argument("--serial", help="with --adb: the device (`adb devices`)")
    c.add_argument("--out", type=Path, default=Path("bench"), help="report folder to merge into")


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give token counts like 128,512") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': token counts are >= 1")
    return values


def _depths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give draft depths like 0,1,2,3") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"'{text}': draft depths are >= 0 (0 = AR)")
    return values


def _bench_depths(text: str) -> tuple[int | str, ...]:
    """Pinned depths, and `auto` (the adaptive depth) if named: 0,1,2,3,auto."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    pinned = [x for x in items if x != "auto"]
    auto: tuple[str, ...] = ("auto",) if "auto" in items else ()
    return (*(_depths(",".join(pinned)) if pinned else ()), *auto)


def run_bench(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from edgemtp.devices.profiles import USER_PROFILE_DIR
    from edgemtp.runtime import bench
    from edgemtp.runtime.bench_report import text_table, write_report
    from edgemtp.runtime.demo import PROMPTS
    from edgemtp.runtime.session import Session

    _check_positive("--threads", args.threads)
    say = lambda m: print(f"-- {m}", file=sys.stderr, flush=True)  # noqa: E731
    texts = bench.read_prompt_texts(args.prompts) if args.prompts else []
    if not args.prompts and PROMPTS.is_file():
        texts = json.loads(PROMPTS.read_text())
    threads = args.threads or _bundle_threads(args.bundle)
    session = Session.from_bundle(
        args.bundle,
        delegate=args.delegate,
        threads=threads,
        verify=not args.no_verify,
        progress=say,
    )
    torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    backend = session.backend
    depths = args.mtp or tuple(range(backend.max_draft + 1 if backend.has_drafter else 1))
    plan = bench.BenchPlan(
        args.pp, args.tg, depths, args.repeat, args.tg_prompt, args.acceptance_oracle, args.seed
    )
    device = args.device
    if device is None and (USER_PROFILE_DIR / "host.toml").is_file():
        device = "host"
    runs = bench.run_bench(session, plan, texts, say)
    predictions = None
    if device not in (None, "none"):
        predictions = bench.predict(args.bundle, device, session.info["delegate"], plan, runs)
    elif device is None:
        say("no host profile: `edgemtp devices calibrate` once to see predictions beside these")
    command = "edgemtp " + shlex.join(["bench", *sys.argv[2:]])
    doc = bench.result_document(
        command,
        bench.machine_info(threads),
        bench.bundle_info(args.bundle, session.info),
        plan,
        runs,
        predictions,
    )
    out = write_report([doc], args.out)
    print(text_table([doc]))
    print(f"wrote {out}/bench.md, its plots and {out}/results/")
    return 0


def run_bench_collect(args: argparse.Namespace) -> int:
    from edgemtp.runtime.bench_report import collect, read_result, text_table

    files = collect(args.out, args.folder, args.adb, args.serial)
    print(text_table([read_result(f) for f in files]))
    print(f"wrote {args.out}/bench.md from {len(files)} result files")
    return 0


def _add_conformance(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conformance",
        help="write conformance vectors: every greedy decode decision on a bundle, for the "
        "app-side decode core (apps/core) to replay without the model",
    )
    p.add_argument("--bundle", type=Path, required=True, help="an export bundle")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for vectors.json (replaced when it holds nothing else)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=4,
        help="prompts; the first 4 exercise one prefill chunk, several chunks, the sliding "
        "ring wrapping and the context end, more get seeded random lengths",
    )
    p.add_argument("--tokens", type=int, default=48, help="committed tokens per generation")
    p.add_argument(
        "--depths", type=_depths, help="pinned draft depths (default: 0 to the bundle's deepest)"
    )


def run_conformance(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.runtime.conformance import (
        check_out,
        record_vectors,
        replay_vectors,
        write_vectors,
    )

    _check_positive("--prompts", args.prompts)
    _check_positive("--tokens", args.tokens, 2)
    check_out(args.out)  # before minutes of decoding, not after
    say = lambda m: print(f"-- {m}", file=sys.stderr, flush=True)  # noqa: E731
    torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    vectors = record_vectors(
        args.bundle, prompts=args.prompts, tokens=args.tokens, depths=args.depths, progress=say
    )
    checked = replay_vectors(vectors)  # the engine agrees with what it is about to publish
    path = write_vectors(vectors, args.out)
    rounds = [r for c in vectors["cases"] for r in c["rounds"]]
    print(
        f"wrote {path}: {checked['cases']} cases, {checked['rounds']} decode rounds "
        f"({sum(r['accepted'] for r in rounds)} of {sum(r['depth'] for r in rounds)} drafts "
        f"accepted), {checked['method_choices']} method choices; replayed by the Python runtime"
    )
    return 0


def _add_devices(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="device profiles: list them, calibrate this host")
    what = p.add_subparsers(dest="devices_command", required=True)
    what.add_parser("list", help="the device profiles and their delegates")
    cal = what.add_parser("calibrate", help="measure this machine and write its profile")
    cal.add_argument("--threads", type=int, default=2, help="threads to measure with")
    cal.add_argument(
        "--out", type=Path, help="profile file (default: ~/.cache/edgemtp/profiles/host.toml)"
    )
    cal.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # small sizes: tests


def run_devices(args: argparse.Namespace) -> int:
    from edgemtp.devices.profiles import USER_PROFILE_DIR, list_profiles, load_profile

    if args.devices_command == "list":
        for name in list_profiles():
            profile = load_profile(name)
            delegates = ", ".join(profile.delegates)
            print(f"{name:22s} {profile.name} ({delegates}; {len(profile.estimates())} estimates)")
        return 0
    from edgemtp.devices.calibrate import calibrate

    _check_positive("--threads", args.threads)
    out = args.out or USER_PROFILE_DIR / "host.toml"
    say = lambda m: print(f"-- {m}", file=sys.stderr, flush=True)  # noqa: E731
    text = calibrate(args.threads, say, quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        tmp.write_text(text)
        load_profile(tmp)  # what was measured reads back as a profile
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    print(text, end="")
    print(f"wrote {out} (edgemtp simulate --device {out.stem if not args.out else out})")
    return 0


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


def run_simulate(args: argparse.Namespace) -> int:
    from edgemtp.devices.profiles import load_profile
    from edgemtp.devices.simulator import model_from_bundle, model_from_preset, simulate
    from edgemtp.export.static import auto_context_buckets

    try:
        depths = tuple(sorted({int(d) for d in (args.mtp or "0").split(",")}))
    except ValueError:
        raise EdgeMTPError(f"--mtp {args.mtp!r}: give draft depths like 0,1,2,3") from None
    for flag, value in (("--prompt", args.prompt), ("--gen", args.gen)):
        _check_positive(flag, value)
    device = load_profile(args.device)
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
    result = simulate(
        model,
        device,
        args.delegate,
        depths,
        _acceptance(args.acceptance, max(depths)),
        args.prompt,
        args.gen,
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
        f"assumptions: {a['compute_dtype']} compute, {a['dispatch']}, {a['launches']}; "
        f"acceptance {a['acceptance']}; {len(a['estimated_profile_numbers'])} profile "
        "numbers are estimates (--json lists them)"
    )
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from edgemtp.runtime.demo import ASSISTANT, TARGET, DemoSettings
    from edgemtp.runtime.demo import run_demo as demo

    _check_positive("--tokens", args.tokens, 2)
    _check_positive("--repeat", args.repeat)
    _check_positive("--depth", args.depth)
    settings = DemoSettings(depth=args.depth, tokens=args.tokens, repeat=args.repeat)

    def say(message: str) -> None:  # progress on stderr, also with --json
        print(f"-- {message}", file=sys.stderr, flush=True)

    result = demo(args.target or TARGET, args.drafter or ASSISTANT, args.out, settings, say)
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["prompt"] + result["text"])
    print(
        f"\nAR  {result['ar_decode_tok_s']:7.1f} tok/s\n"
        f"MTP {result['mtp_decode_tok_s']:7.1f} tok/s (depth {result['depth']}): "
        f"{result['speedup']:.2f}x, {result['mean_committed_per_forward']:.2f} tokens per "
        f"target forward; MTP tokens equal AR's in {result['mtp_runs_equal_ar']} of "
        f"{result['runs'] * result['prompts']} runs\n"
        f"medians of {result['runs']} runs x {result['prompts']} prompts x "
        f"{result['tokens_per_run']} tokens; bundle: {result['bundle']}"
    )
    for mode, phases in result["decode_ms_per_token_by_phase"].items():
        split = ", ".join(f"{phase} {ms:.3f}" for phase, ms in phases.items() if ms)
        print(f"{mode.upper():3} ms per token: {split}")
    return 0


def _check_positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise EdgeMTPError(f"{name} must be >= {minimum}, got {value}")


def default_threads(cfg) -> int:
    """One thread when a decode step is too small to split (under ~50 MFLOP of matmuls)."""
    import torch

    from edgemtp.model.cost import layer_flops

    step = sum(layer_flops(cfg, spec, range(0, 1)) for spec in cfg.layers)
    step += 2 * cfg.hidden_size * cfg.vocab_size
    return 1 if step < 5e7 else torch.get_num_threads()


def _open_session(args: argparse.Namespace):
    """The session `generate` runs: a bundle, or the reference engine over checkpoints."""
    from edgemtp.runtime.session import Session

    def progress(msg: str) -> None:
        if not args.json:
            print(f"-- {msg}", file=sys.stderr, flush=True)

    if args.bundle is not None:
        for flag, given in (("--drafter", args.drafter), ("--max-context", args.max_context)):
            if given:
                raise EdgeMTPError(f"{flag} is for --model; a bundle carries its own")
        if args.no_verify:
            progress("--no-verify: not checking the bundle's files against their SHA-256")
        return Session.from_bundle(
            args.bundle,
            delegate=args.delegate,
            threads=args.threads or _bundle_threads(args.bundle),
            verify=not args.no_verify,
            progress=progress,
        )
    if args.delegate not in (None, "cpu"):
        raise EdgeMTPError("--model runs the reference engine on the CPU; export a bundle first")
    if args.mtp not in ("auto", 0) and not args.drafter:
        raise EdgeMTPError("--mtp needs --drafter (an MTP assistant checkpoint)")
    return Session.from_checkpoints(
        args.model,
        args.drafter,
        max_context=args.max_context,
        max_draft=max(args.max_draft, args.mtp if isinstance(args.mtp, int) else 0),
        prefill_chunk=args.prefill_chunk,
        prune=not args.no_prune,
    )


def _bundle_threads(bundle: Path) -> int:
    from edgemtp.model.checkpoint import target_config

    try:
        raw = json.loads((bundle / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 1  # the session names the problem
    return default_threads(target_config(raw, str(bundle)))


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.runtime.probes import EnergyMeter, peak_rss_mb
    from edgemtp.runtime.sampling import SamplingParams

    _check_positive("--max-new-tokens", args.max_new_tokens)
    _check_positive("--prefill-chunk", args.prefill_chunk)
    _check_positive("--threads", args.threads)
    _check_positive("--max-context", args.max_context, 2)
    _check_positive("--max-draft", args.max_draft, 0)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    session = _open_session(args)
    load_s = time.perf_counter() - t0
    if args.bundle is None:
        torch.set_num_threads(args.threads or default_threads(session.backend.target.cfg))
    else:
        torch.set_num_threads(1)  # host-side lookups only; the program has its own threads
    tokenizer = session.tokenizer
    if args.prompt is not None:
        if tokenizer is None:
            where = args.bundle or args.model
            raise EdgeMTPError(f"{where}: no tokenizer.json; pass --prompt-ids instead")
        prompt = tokenizer.encode_prompt(args.prompt, chat=args.chat)
    else:
        if args.chat:
            raise EdgeMTPError("--chat needs --prompt text")
        prompt = args.prompt_ids
    stop_ids = () if args.ignore_eos else session.stop_ids

    out_ids: list[int] = []
    printed = [0]  # characters of the decoded text already written

    def stream(new: list[int]) -> None:
        if args.json:
            return
        out_ids.extend(new)
        if tokenizer:
            text = tokenizer.decode(out_ids)
            sys.stdout.write(text[printed[0] :])
            printed[0] = len(text)
        else:
            sys.stdout.write("".join(f"{t} " for t in new))
        sys.stdout.flush()

    energy = EnergyMeter(battery_wh=args.battery_wh)
    energy.begin()
    with torch.no_grad():
        result = session.generate(
            prompt,
            args.max_new_tokens,
            mtp=args.mtp,
            params=params,
            stop_ids=tuple(stop_ids),
            on_tokens=stream,
        )
    metrics = {
        **result.metrics(),
        "load_s": load_s,
        "stop_reason": result.stop_reason,
        "peak_rss_mb": peak_rss_mb(),
        "energy": energy.report(len(result.tokens)),
        "mtp": args.mtp,
    }
    if args.mtp == "auto" and session.adaptive is not None:
        metrics["adaptive"] = session.adaptive.summary()
    if args.json:
        payload = {
            "tokens": result.tokens,
            "text": tokenizer.decode(result.tokens) if tokenizer else None,
            "prompt_ids": prompt,
            "session": session.info,
            "metrics": metrics,
            "trace": [asdict(step) for step in result.steps],
        }
        print(json.dumps(payload))
    else:
        print()
        rate = metrics["decode_tok_s"]
        summary = [
            f"{metrics['generated_tokens']} tokens",
            f"ttft {metrics['ttft_s'] * 1000:.1f} ms",
            f"prefill {metrics['prefill_tok_s']:.1f} tok/s" if metrics["prefill_tok_s"] else "",
            f"decode {rate:.1f} tok/s" if rate else "",
        ]
        if metrics["drafted"]:
            depths = ", ".join(f"{k}x{n}" for k, n in metrics["mtp_depths_used"].items())
            summary.append(
                f"accepted {metrics['accepted']}/{metrics['drafted']} drafts, "
                f"{metrics['mean_committed_per_forward']:.2f} tokens/forward (depth x rounds: "
                f"{depths})"
            )
        if metrics["peak_rss_mb"] is not None:
            summary.append(f"peak RSS {metrics['peak_rss_mb']:.0f} MB")
        print("-- " + ", ".join(s for s in summary if s), file=sys.stderr)
    if result.stop_reason == "interrupted":
        print(f"edgemtp generate: interrupted after {len(result.tokens)} tokens", file=sys.stderr)
        return 130
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
    from edgemtp.runtime.probes import peak_rss_mb

    settings = Settings(
        scheme=args.scheme,
        group_size=args.group or (32 if args.scheme == "q4_0" else 128),
        symmetric=not args.asymmetric,
        method=args.method,
        embeddings=args.embeddings,
        ple=args.ple,
        scale_dtype=torch.bfloat16 if args.scale_dtype == "bfloat16" else torch.float16,
    )
    settings.validate()
    hessians = None
    if args.method == "gptq":
        hessians = _calibration_hessians(args)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    summary = quantize_checkpoint(
        args.model, args.out, settings, hessians, progress=progress, overwrite=args.force
    )
    peak_mb = peak_rss_mb()
    print(
        f"wrote {args.out}: {summary['bytes'] / 2**30:.3f} GiB in {summary['seconds']:.1f} s, "
        f"peak RSS {peak_mb:.0f} MB"
    )
    if summary["kept_fp16"]:
        print(
            f"kept in fp16 (input width not a multiple of the group): {len(summary['kept_fp16'])} "
            f"tensors, e.g. {summary['kept_fp16'][0]}"
        )
    if args.report:
        report_args = argparse.Namespace(
            model=args.model,
            quantized=args.out,
            text=args.report,
            tokens=2048,
            drafter=args.drafter,
            quantized_drafter=None,
            out=args.out / "quantization_report",
        )
        return run_report(report_args)
    return 0


def run_report(args: argparse.Namespace) -> int:
    import json

    import torch

    from edgemtp.model.checkpoint import load_drafter, load_target
    from edgemtp.quantize.report import build_report, plot_weight_error
    from edgemtp.runtime.tokenizer import token_file

    ids = token_file(args.text, args.model, args.tokens + 1)
    reference, quantized = load_target(args.model), load_target(args.quantized)
    if reference.cfg.layers != quantized.cfg.layers:
        raise EdgeMTPError(f"{args.quantized} is not a quantization of {args.model}")
    drafters = None
    if args.drafter:
        float_drafter = load_drafter(args.drafter, reference.cfg)
        q_drafter = (
            load_drafter(args.quantized_drafter, quantized.cfg)
            if args.quantized_drafter
            else float_drafter
        )
        drafters = (float_drafter, q_drafter)

    def progress(msg: str) -> None:
        print(f"report: {msg}", file=sys.stderr, flush=True)

    with torch.no_grad():
        report = build_report(reference, quantized, ids, drafters, progress)
    print(report.table())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report.as_dict(), indent=1))
        args.out.with_suffix(".txt").write_text(report.table() + "\n")
        plot_weight_error(report, args.out.with_suffix(".png"), args.quantized.name)
        print(f"wrote {args.out}.json, .txt and .png")
    return 0


def _calibration_hessians(args: argparse.Namespace) -> dict:
    from edgemtp.model.checkpoint import load_target
    from edgemtp.quantize.gptq import collect_hessians
    from edgemtp.runtime.tokenizer import token_file

    if args.calib is None:
        raise EdgeMTPError("--method gptq needs --calib FILE (a few thousand tokens of text)")
    ids = token_file(args.calib, args.model, args.calib_tokens)
    target = load_target(args.model)
    chunk = 512
    return collect_hessians(target, [ids[i : i + chunk] for i in range(0, len(ids), chunk)])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def context_buckets(text: str, args: argparse.Namespace) -> tuple[int, ...]:
    from edgemtp.export.static import auto_context_buckets

    if text == "none":
        return ()
    if text == "auto":
        cpu = (args.backend, args.delegate) == ("executorch", "cpu")
        return auto_context_buckets(args.max_context) if cpu else ()
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise EdgeMTPError(
            f"--context-buckets {text!r}: give token counts like 512,2048, 'auto' or 'none'"
        ) from None


def _check_context(max_context: int, max_draft: int, cfg: TextConfig, model: Path) -> None:
    """A context the model was not trained for, or a cache larger than this machine's memory,
    is refused before anything is allocated."""
    from edgemtp.runtime.kv_cache import cache_bytes
    from edgemtp.runtime.probes import physical_memory

    if max_context > cfg.max_position_embeddings:
        raise EdgeMTPError(
            f"--max-context {max_context}: {model} attends to at most "
            f"{cfg.max_position_embeddings} positions (max_position_embeddings); use no more"
        )
    need, have = cache_bytes(cfg, max_context, max_draft), physical_memory()
    if need > have:
        raise EdgeMTPError(
            f"--max-context {max_context}: the KV cache alone takes {need / 2**30:.2f} GiB, more "
            f"than this machine's {have / 2**30:.2f} GiB of memory; use a smaller --max-context"
        )


def run_export(args: argparse.Namespace) -> int:
    import torch

    from edgemtp.export.bundle import ExportRequest, export
    from edgemtp.export.static import StaticShapes
    from edgemtp.model.checkpoint import open_checkpoint, target_config
    from edgemtp.runtime.kv_cache import cache_slots
    from edgemtp.runtime.probes import peak_rss_mb

    _check_positive("--max-context", args.max_context, 2)
    if args.draft_depth is None:
        args.draft_depth = 3 if args.drafter else 0
    _check_positive("--draft-depth", args.draft_depth, 0)
    _check_positive("--prefill-chunk", args.prefill_chunk)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    if not args.model.exists():
        raise EdgeMTPError(f"{args.model} does not exist")
    source = open_checkpoint(args.model)
    cfg = target_config(source.config, str(source.path))
    _check_context(args.max_context, args.draft_depth, cfg, args.model)
    smallest = min(cache_slots(cfg, args.max_context, args.draft_depth).values())
    chunk = args.prefill_chunk or min(128, smallest)
    if chunk > smallest:
        raise EdgeMTPError(
            f"--prefill-chunk {chunk} exceeds the smallest cache ({smallest} slots: sliding "
            f"window {cfg.sliding_window} + draft depth {args.draft_depth} + 1); use <= {smallest}"
        )
    buckets = context_buckets(args.context_buckets, args)
    try:
        shapes = StaticShapes(args.max_context, args.draft_depth, chunk, buckets)
    except ValueError as e:
        raise EdgeMTPError(f"--context-buckets: {e}") from None
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    request = ExportRequest(
        args.model,
        args.drafter,
        args.quant,
        args.backend,
        args.delegate,
        shapes,
        args.out,
        args.force,
        args.activations,
        args.attention,
    )
    manifest = export(request, progress)
    size = sum(f["bytes"] for f in manifest["files"].values())
    peak_mb = peak_rss_mb()
    print(
        f"wrote {args.out}: {size / 2**20:.1f} MiB ({manifest['quantization']['scheme']}, "
        f"{args.backend}/{args.delegate}, {len(manifest['methods'])} methods) in "
        f"{time.perf_counter() - t0:.1f} s, peak RSS {peak_mb:.0f} MB"
    )
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from edgemtp.model.synth import write_preset

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    out = write_preset(
        args.preset,
        args.out,
        scale=args.scale,
        seed=args.seed,
        dtype=args.dtype,
        init_std=args.init_std,
        progress=progress,
        overwrite=args.force,
    )
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-target"]:  # its own parser: options pass through whole
        return run_train_target(argv[1:])
    parser = argparse.ArgumentParser(prog="edgemtp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_synth(sub)
    _add_quantize(sub)
    _add_report(sub)
    _add_export(sub)
    _add_distill(sub)
    _add_train_target(sub)
    _add_demo(sub)
    _add_simulate(sub)
    _add_devices(sub)
    _add_bench(sub)
    _add_conformance(sub)
    if argv[:2] == ["bench", "collect"]:
        argv = ["bench-collect", *argv[2:]]
    args = parser.parse_args(argv)
    commands = {
        "generate": run_generate,
        "synth": run_synth,
        "quantize": run_quantize,
        "quantize-report": run_report,
        "export": run_export,
        "distill": run_distill,
        "demo": run_demo,
        "simulate": run_simulate,
        "devices": run_devices,
        "bench": run_bench,
        "bench-collect": run_bench_collect,
        "conformance": run_conformance,
    }
    name = args.command.replace("-", " ") if args.command == "bench-collect" else args.command
    # a killed export or quantize cleans up as after Ctrl-C
    terminate = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return commands[args.command](args)
    except EdgeMTPError as err:
        print(f"edgemtp {name}: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"edgemtp {name}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"edgemtp {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, terminate)


if __name__ == "__main__":
    sys.exit(main())

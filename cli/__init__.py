"""`edgemtp` command line: generate, synth, quantize, quantize-report, export, distill,
train-target, demo, simulate, devices, bench, conformance."""

from __future__ import annotations

import argparse
import signal
import sys

# each module adds its subcommands' parsers and runs them; heavy imports wait inside the runs
from edgemtp.cli import (
    bench,
    conformance,
    demo,
    devices,
    export,
    generate,
    quantize,
    simulate,
    synth,
    train,
)
from edgemtp.errors import EdgeMTPError

# in the order `edgemtp --help` lists them
SUBCOMMANDS = (
    generate,
    synth,
    quantize,
    export,
    train,
    demo,
    simulate,
    devices,
    bench,
    conformance,
)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-target"]:  # its own parser: options pass through whole
        return train.run_train_target(argv[1:])
    parser = argparse.ArgumentParser(prog="edgemtp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    if argv[:2] == ["bench", "collect"]:
        argv = ["bench-collect", *argv[2:]]
    args = parser.parse_args(argv)
    commands = {
        "generate": generate.run,
        "synth": synth.run,
        "quantize": quantize.run,
        "quantize-report": quantize.run_report,
        "export": export.run,
        "distill": train.run_distill,
        "demo": demo.run,
        "simulate": simulate.run,
        "devices": devices.run,
        "bench": bench.run,
        "bench-collect": bench.run_collect,
        "conformance": conformance.run,
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

"""`edgemtp devices`: list the device profiles, calibrate this host."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgemtp.cli.common import check_positive, say


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="device profiles: list them, calibrate this host")
    what = p.add_subparsers(dest="devices_command", required=True)
    what.add_parser("list", help="the device profiles and their delegates")
    cal = what.add_parser("calibrate", help="measure this machine and write its profile")
    cal.add_argument("--threads", type=int, default=2, help="threads to measure with")
    cal.add_argument(
        "--out", type=Path, help="profile file (default: ~/.cache/edgemtp/profiles/host.toml)"
    )
    cal.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # small sizes: tests


def run(args: argparse.Namespace) -> int:
    from edgemtp.devices.profiles import USER_PROFILE_DIR, list_profiles, load_profile

    if args.devices_command == "list":
        for name in list_profiles():
            profile = load_profile(name)
            delegates = ", ".join(profile.delegates)
            print(f"{name:22s} {profile.name} ({delegates}; {len(profile.estimates())} estimates)")
        return 0
    from edgemtp.devices.calibrate import calibrate

    check_positive("--threads", args.threads)
    out = args.out or USER_PROFILE_DIR / "host.toml"
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

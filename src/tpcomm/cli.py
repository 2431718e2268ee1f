"""The ``tpcomm`` command: ``tpcomm perf <collective> [nccl-tests flags]``, ``tpcomm doctor``,
``tpcomm tune``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from . import doctor, perf, tune

    parser = argparse.ArgumentParser(prog="tpcomm", description="tpcomm command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("perf", help="benchmark a collective (nccl-tests flags and columns)")
    perf.add_arguments(p)
    d = sub.add_parser(
        "doctor", help="check this machine: shm dir, stale segments, CPUs, paths per collective"
    )
    doctor.add_arguments(d)
    t = sub.add_parser(
        "tune", help="measure this machine's switch points and write the profile tpcomm uses"
    )
    tune.add_arguments(t)
    args = parser.parse_args(argv)
    if args.command == "perf":
        return perf.run(args)
    if args.command == "doctor":
        return doctor.run(args)
    if args.command == "tune":
        return tune.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

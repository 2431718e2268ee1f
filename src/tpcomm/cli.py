"""The ``tpcomm`` command: ``tpcomm perf <collective> [nccl-tests flags]``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from . import perf

    parser = argparse.ArgumentParser(prog="tpcomm", description="tpcomm command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("perf", help="benchmark a collective (nccl-tests flags and columns)")
    perf.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "perf":
        return perf.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

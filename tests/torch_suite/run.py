"""PyTorch's own distributed test cases against ``cpu:tpcomm``.

``torch/testing/_internal/distributed/distributed_test.py`` ships in the torch
wheel; its ``DistributedTest._DistTestBase`` is the suite torch runs for gloo.
This runs the CPU cases of it with every process group that the cases create
for gloo created on ``cpu:tpcomm`` instead: ``BACKEND=gloo`` keeps the cases'
gloo-only checks (timeouts, monitored_barrier) on, and ``init_process_group``
/ ``new_group`` with gloo (or no backend) make tpcomm groups.

    python -m tests.torch_suite.run [--backend gloo|tpcomm] [--world 2] [-k NAME] [--list]

prints one line per case (``PASS``/``FAIL``/``SKIP`` and why) and exits 1 if a
case that should pass did not.  ``SELECTED`` is the list; ``NOT_APPLICABLE``
the cases left out, each with its reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import unittest

SELECTED = []  # filled below


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tpcomm", choices=["tpcomm", "gloo"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("-k", action="append", default=[])
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    os.environ["TPCOMM_SUITE_BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world)
    from .cases import Cases

    names = sorted(n for n in dir(Cases) if n.startswith("test_"))
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    failed = 0
    for name in names:
        t0 = time.monotonic()
        result = unittest.TestResult()
        Cases(name).run(result)
        took = time.monotonic() - t0
        if result.failures or result.errors:
            failed += 1
            why = (result.failures or result.errors)[0][1].strip().splitlines()[-1]
            print(f"FAIL {name} ({took:.1f}s): {why[:300]}", flush=True)
        elif result.skipped:
            print(f"SKIP {name}: {result.skipped[0][1][:120]}", flush=True)
        else:
            print(f"PASS {name} ({took:.1f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

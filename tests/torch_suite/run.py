"""PyTorch's own distributed test cases against ``cpu:tpcomm``.

``torch/testing/_internal/distributed/distributed_test.py`` ships in the torch
wheel; its ``DistributedTest._DistTestBase`` is the suite torch runs for gloo.
This runs the CPU cases of it with every process group that the cases create
for gloo created on ``cpu:tpcomm`` instead: ``BACKEND=gloo`` keeps the cases'
gloo-only checks (timeouts, monitored_barrier) on, and ``init_process_group``
/ ``new_group`` with gloo (or no backend) make tpcomm groups.

    python -m tests.torch_suite.run [--backend gloo|tpcomm] [--world 2] [-k NAME] [--list]

prints one line per case (``PASS``/``FAIL``/``SKIP`` and why; a pass that
handed some call to a gloo group says ``via gloo``) and exits 1 if a case
that should pass did not.  ``SELECTED`` is the list; ``NOT_APPLICABLE``
the cases left out, each with its reason.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import unittest

# the CPU collective, point-to-point and group cases (DDP and models are
# workloads, measured in benchmarks/, not cases of this list)
_PREFIXES = (
    "test_Backend_enum_class", "test_all_gather", "test_all_reduce", "test_all_to_all",
    "test_barrier", "test_batch_isend_irecv", "test_broadcast", "test_coalescing_manager",
    "test_destroy", "test_gather", "test_get_backend", "test_get_future", "test_get_rank",
    "test_irecv", "test_isend", "test_monitored_barrier", "test_new_subgroups", "test_reduce",
    "test_scatter", "test_send_recv", "test_sparse_all_reduce",
)  # fmt: skip
_NOT_CPU = ("cuda", "nccl", "gpu", "_ucc")

# cases that check the backend's name: run with BACKEND=tpcomm (--backend named)
NAMED = ("test_Backend_enum_class", "test_get_backend")

# cases that cannot apply to a backend not named gloo, and why
NOT_APPLICABLE = {
    "test_monitored_barrier_gloo": "torch refuses monitored_barrier for any backend not "
    "named gloo (distributed_c10d checks the name before it calls the group)",
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_allreduce_hang": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_failure_order": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_wait_all_ranks": "as test_monitored_barrier_gloo",
}


def selected(names: list, mode: str) -> list:
    """The cases of ``names`` this mode runs."""
    cpu = [n for n in names if n.startswith(_PREFIXES) and not any(x in n for x in _NOT_CPU)]
    if mode == "named":
        return [n for n in cpu if n in NAMED]
    return [n for n in cpu if n not in NAMED and n not in NOT_APPLICABLE]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tpcomm", choices=["tpcomm", "gloo", "named"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("-k", action="append", default=[])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--not-applicable", action="store_true", help="run NOT_APPLICABLE's cases")
    args = ap.parse_args()
    os.environ["TPCOMM_SUITE_BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world)
    from .cases import Cases

    names = selected(sorted(n for n in dir(Cases) if n.startswith("test_")), args.backend)
    if args.not_applicable:
        names = sorted(NOT_APPLICABLE)
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    from .cases import GLOO_USED

    failed = 0
    for name in names:
        t0 = time.monotonic()
        result = unittest.TestResult()
        if os.path.exists(GLOO_USED):
            os.unlink(GLOO_USED)
        Cases(name).run(result)
        took = time.monotonic() - t0
        via = " via gloo" if os.path.exists(GLOO_USED) else ""
        if result.failures or result.errors:
            failed += 1
            text = (result.failures or result.errors)[0][1].strip().splitlines()
            # the exception a rank raised, not the harness's last word about it
            raised = [ln.strip() for ln in text if re.match(r"\s*\w*(Error|Exception)\b:", ln)]
            why = raised[-1] if raised else text[-1]
            print(f"FAIL {name} ({took:.1f}s): {why[:300]}", flush=True)
        elif result.skipped:
            print(f"SKIP {name}: {result.skipped[0][1][:120]}", flush=True)
        else:
            print(f"PASS {name} ({took:.1f}s){via}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

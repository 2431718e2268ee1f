"""``tpcomm perf``: nccl-tests-style benchmarks of the shared-memory engine.

One table row per size: tpcomm's time and bandwidths, the number of wrong
values (checked outside the timed loop, on fresh data), and, in the same
run, gloo's time for the same call and a single-thread memcpy of the same
bytes (the physical bound of any shared-memory collective).

The package: ``table`` (the collectives, nccl-tests' vtable), ``timing`` (the
loops), ``worker`` (one rank), ``cli`` (flags, run, report), ``mpi`` and
``mpi_rank`` (the MPI side, under mpirun).
"""

from __future__ import annotations

from .cli import add_arguments, main, run
from .table import COLLECTIVES, parse_size

__all__ = ["COLLECTIVES", "add_arguments", "main", "parse_size", "run"]

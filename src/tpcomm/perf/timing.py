"""Timing loops of ``tpcomm perf`` (the MPI side uses the same)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..ops import ReduceOp
from ..shm.engine import touch

__all__ = ["agree", "fresh_timed", "measured", "timed"]


def timed(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measured(
    comm: Any,
    call: Callable[[], Any],
    target: float,
    most: int | None = None,
    timer: Callable[[int], float] | None = None,
) -> float:
    """call() timed on every rank alike: warmed up, probed, then as many
    iterations as take about ``target`` seconds on the slowest rank (at most
    ``most``), after a barrier; ``timer(n)``: how n iterations are timed
    (default: timed(call, n))."""
    for _ in range(3):
        call()
    probe = timed(call, 3)
    n = max(3, int(target / max(probe, 1e-7)))
    n = agree(comm, n if most is None else min(most, n))
    comm.barrier()
    return timer(n) if timer is not None else timed(call, n)


def fresh_timed(call: Callable[[dict], Any], st: dict, iters: int, barrier) -> float:
    """--fresh: time call(st) with st["x"] rewritten before each call (as a
    producer of new activations would), minus the rewrite's own time measured
    alone in the same way.  Without it, an implementation that reads a peer's
    unchanged input in place (single-copy MPI) finds those lines still in its
    own cache from the previous call, which no real workload offers."""
    touch = _toucher(st["x"])

    def both():
        touch()
        call(st)

    barrier()
    t = timed(both, iters)
    barrier()
    return max(t - timed(touch, iters), 0.0)


def _toucher(x: torch.Tensor) -> Callable[[], None]:
    """Rewrite every cache line of x in place, values unchanged (shm touch:
    0.1 us at 1 KiB, where x.fill_ costs ~3 us of torch dispatch here)."""
    addr, nbytes = x.data_ptr(), x.numel() * x.element_size()
    return lambda: touch(addr, nbytes)


def agree(comm, value: int) -> int:
    """The largest of every rank's value (so all ranks loop the same count)."""
    t = torch.tensor([value], dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.MAX)
    return int(t.item())

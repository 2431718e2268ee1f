"""Timing loops of ``tpcomm perf`` (the MPI side uses the same)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..ops import ReduceOp
from ..shm.engine import touch

__all__ = ["agree", "fresh_timed", "loop_timed", "measured", "shaped", "timed"]

# the memory the decode-shaped work between calls walks through (--gap-us):
# more than any core's L2, so that the lines a call leaves in its caches are
# gone by the next call, as an engine's layer of matmuls leaves them
EVICT_BYTES = 32 << 20
_EVICT_CHUNK = 64 << 10


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
    return _minus_before(call, st, iters, barrier, _toucher(st["x"]))


def _minus_before(
    call: Callable[[dict], Any], st: dict, iters: int, barrier: Any, before: Callable[[], None]
) -> float:
    """Seconds per call(st) with before() ahead of each, minus before()'s own
    time, timed alone the same way."""

    def both():
        before()
        call(st)

    barrier()
    t = timed(both, iters)
    barrier()
    return max(t - timed(before, iters), 0.0)


def shaped(cfg: dict) -> bool:
    """Whether the calls are timed decode-shaped (--gap-us, --skew-us)."""
    return bool(cfg.get("gap_us") or cfg.get("skew_us"))


def loop_timed(
    call: Callable[[dict], Any],
    st: dict,
    iters: int,
    barrier: Any,
    cfg: dict,
    rank: int,
    world: int,
) -> float:
    """Seconds per call(st), timed as the flags say: plain (after a barrier),
    --fresh (fresh_timed), or decode-shaped: before every call, --gap-us of
    work that walks through EVICT_BYTES of memory (a layer's matmuls between
    two all-reduces: the caches hold nothing of the last call), and on call
    i rank i % world arrives --skew-us later than the others (spinning), as
    ranks of an engine's decode loop do.  What comes before the calls (the
    rewrite, the work, the spin), timed alone the same way, is subtracted;
    so the time is the call's, the waits for a late rank included."""
    if not shaped(cfg):
        if cfg.get("fresh"):
            return fresh_timed(call, st, iters, barrier)
        barrier()
        return timed(lambda: call(st), iters)
    return _minus_before(call, st, iters, barrier, _before_calls(cfg, st, rank, world))


_evict: list = []


def _before_calls(cfg: dict, st: dict, rank: int, world: int) -> Callable[[], None]:
    """What a decode-shaped loop does before each call (loop_timed)."""
    if not _evict:
        _evict.append(torch.ones(EVICT_BYTES, dtype=torch.uint8))
    base = _evict[0].data_ptr()
    gap_ns = int(cfg.get("gap_us", 0) * 1000)
    skew_ns = int(cfg.get("skew_us", 0) * 1000)
    fresh = _toucher(st["x"]) if cfg.get("fresh") else None
    clock = time.perf_counter_ns
    state = [0, 0]  # the call's number; where the walk through the memory is

    def before() -> None:
        end = clock() + gap_ns
        while gap_ns and clock() < end:
            touch(base + state[1], _EVICT_CHUNK)
            state[1] = (state[1] + _EVICT_CHUNK) % EVICT_BYTES
        if fresh is not None:
            fresh()
        if skew_ns and state[0] % world == rank:
            late = clock() + skew_ns
            while clock() < late:
                pass
        state[0] += 1

    return before


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

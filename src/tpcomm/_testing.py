"""Hooks for tpcomm's own tests: what a test needs to see or force inside a
Communicator, without reaching into its engine.

Nothing here is public API or stable; every hook goes through the shared-memory
path's engine (``shm/engine.py``), the only Python that calls the C core.
"""

from __future__ import annotations

from typing import Any, Optional

from . import construction
from .shm import engine as _engine
from .shm.segment import segment_size

__all__ = [
    "MAGIC",
    "cma_init",
    "fault_check_delay",
    "fault_stores",
    "fault_cma_addr",
    "isa_variants",
    "kernel_isa",
    "layout",
    "peer_pids",
    "send_raw",
    "stores",
    "reduce_kernel",
    "rounds",
    "segment_size",
    "restore",
    "set_twoshot_min",
    "set_cma_allreduce_min",
    "set_threads",
    "symmetric_buffers",
    "threads",
    "touch",
]

MAGIC = _engine.MAGIC
kernel_isa = _engine.kernel_isa
isa_variants = _engine.isa_variants
touch = _engine.touch


def reduce_kernel(dtype: int, op: int, dst: int, srcs: list, count: int, nthreads: int = 1):
    """The reduce kernel alone, in the variant TPCOMM_ISA names now."""
    _engine.select_kernels()
    _engine.reduce_kernel(dtype, op, dst, srcs, count, nthreads)


engine = construction.engine_of


def _eng(comm: Any) -> _engine.ShmEngine:
    eng = engine(comm)
    if eng is None:
        raise ValueError("this Communicator has no shared-memory engine (world size 1?)")
    return eng


def rounds(comm: Any) -> int:
    """Collective rounds this rank has published so far (0 without an engine)."""
    eng = engine(comm)
    return eng.round if eng is not None else 0


def threads(comm: Any) -> int:
    """Threads a large copy or reduction of this rank uses."""
    return _eng(comm).threads


def set_twoshot_min(comm: Any, nbytes: Optional[int]) -> None:
    """Force this rank's all-reduce switch point (-1: never two-shot; None: back
    to the agreed setting)."""
    eng = _eng(comm)
    if nbytes is None:
        eng.adjust(twoshot_min=eng.settings.twoshot_min, twoshot_min16=eng.settings.twoshot_min16)
    else:
        eng.adjust(twoshot_min=nbytes, twoshot_min16=nbytes)


def set_cma_allreduce_min(comm: Any, nbytes: Optional[int]) -> None:
    """Force this rank's single-copy all-reduce switch point (-1: never; None:
    back to the agreed setting).  Only where single-copy reads are on."""
    eng = _eng(comm)
    eng.adjust(cma_ar_min=eng.settings.cma_ar_min if nbytes is None else nbytes)


def set_threads(comm: Any, n: int, min_bytes: int) -> None:
    """This rank's threads, sharing jobs of min_bytes and more (-1: none);
    restore() undoes it."""
    _eng(comm).adjust(threads=n, threads_min=min_bytes)


def reprobe(comm: Any) -> None:
    """Forget what this rank's probes of output pages found (_native/pages.c):
    the next call of every size probes."""
    eng = _eng(comm)
    eng._native.set_populate_min(eng.current.populate_min)


def restore(comm: Any) -> None:
    """Every setting as agreed at creation, single copy included (collective)."""
    _eng(comm).restore()


def cma_init(comm: Any, want: bool, min_bytes: int) -> tuple[int, bool]:
    """Agree again, collectively, on single-copy reads: (status, on)."""
    return _eng(comm).agree_single_copy(want, min_bytes)


def set_zero_copy_auto(comm: Any, on: bool) -> None:
    """Rank 0 chooses zero copy or the copies as calls run, or not (off: zero
    copy where its window says), from the next call on (collective: a barrier
    makes the call after it the first under the new setting)."""
    _eng(comm).adjust(zc_auto=on)
    comm.barrier()


def stores(comm: Any) -> dict:
    """What this rank's all_reduce chunks learnt about their stores."""
    return _eng(comm).stores()


def fault_stores(
    comm: Any, plain_us: float, nt_us: float, leftover_us: float = 0.0, chunks: int = 0
) -> None:
    """Make the plain / non-temporal copies of all_reduce chunks (those that
    choose their stores as they run) this much slower, and the first ``chunks``
    plain ones of a size after a non-temporal one ``leftover_us`` more (the
    lines non-temporal stores left in memory)."""
    _eng(comm).fault_stores(plain_us, nt_us, leftover_us, chunks)


def fault_check_delay(comm: Any, us: float) -> None:
    """Sleep this long where a race with a dying peer can be widened."""
    _eng(comm).fault_check_delay(us)


def fault_cma_addr(comm: Any, on: bool) -> None:
    """Publish an input address the peers cannot read (single-copy paths)."""
    _eng(comm).fault_cma_addr(on)


def layout(comm: Any) -> dict:
    """The segment's offsets and sizes as the core computed them."""
    return _eng(comm).layout()


def send_raw(comm: Any, dst: int, stream: bytes) -> Any:
    """Put ``stream`` into the channel to ``dst`` as a message's bytes, lengths
    and all, unchecked (what a buggy or hostile peer could write)."""
    return _eng(comm).send_raw(dst, stream)


def peer_pids(comm_or_engine: Any) -> list:
    """Every rank's pid as written in the segment."""
    is_engine = isinstance(comm_or_engine, _engine.ShmEngine)
    eng = comm_or_engine if is_engine else engine(comm_or_engine)
    return eng.peer_pids()


def symmetric_buffers(comm: Any) -> tuple[int, int]:
    """The empty() buffers this rank still holds: (Python's mappings, the engine's)."""
    eng = _eng(comm)
    return len(eng.symmetric), eng.nsymmetric()

"""The shared-memory engine: a segment mapped by every rank, and its collectives.

The protocol itself (rounds, parity slots, publish/wait, liveness locks,
abort word) is documented at the top of ``_native/tpcomm.h``; this module sets it
up and turns the core's status codes into tpcomm's exceptions.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Optional

from .. import _env, _native, layout
from ..errors import CommError, CommTimeoutError, PeerFailedError
from ..ops import (
    ALL_DTYPES,
    ANY_CODE_DTYPES,
    CODE_DTYPES,
    DTYPE_CODES,
    ReduceOp,
    dense,
)  # fmt: skip
from .settings import NEVER, Settings

__all__ = [
    "KIND_ALL_REDUCE",
    "KIND_BARRIER",
    "KIND_NAMES",
    "MAGIC",
    "NativeEngine",
    "ShmEngine",
    "isa_variants",
    "kernel_isa",
    "reduce_kernel",
    "select_kernels",
    "split_table_problem",
    "time_memcpy",
    "touch",
]

# The core's engine type (custom_ops.py traces its fast_all_reduce), and what
# the other modules of the package use of the core: this module is its only
# caller (segment.py: the segment's header; keys.py: the layout keys of the
# one-call paths; messages.py: the message header; symmetric.py: how many
# buffers may live).
NativeEngine = _native.Engine
MAGIC = _native.MAGIC
VERSION = _native.VERSION
MAX_WORLD = _native.MAX_WORLD
MAX_SYM = _native.MAX_SYM
RS_FLAT = _native.RS_FLAT  # flat_key's kind for reduce_scatter layouts
flat_key = _native.flat_key
segment_size = _native.segment_size


def parse_header(header: bytes) -> list:
    """The (dtype code, shape) of each tensor a binary message header names."""
    return _native.parse_header(header, len(ANY_CODE_DTYPES))


def copy(dst: int, src: int, nbytes: int) -> None:
    _native.copy(dst, src, nbytes)


def select_kernels() -> None:
    """Run the kernel variant TPCOMM_ISA names (auto: the best this CPU has);
    ValueError if the CPU lacks it.  Every variant gives the same bits, so
    ranks need not agree on it."""
    _native.set_isa(_env.isa())


def kernel_isa() -> str:
    """The reduce kernels' variant in use, and why (TPCOMM_ISA, or the CPU)."""
    select_kernels()
    return _native.isa()


def isa_variants() -> list:
    """The kernel variants this CPU can run."""
    return _native.isa_variants()


def reduce_kernel(dtype: int, op: int, dst: int, srcs: list, count: int, nthreads: int = 1):
    """The reduce kernel alone: dst = srcs[0] op ... op srcs[w-1] (tests, benchmarks),
    in the variant last selected (select_kernels)."""
    _native.reduce(dtype, op, dst, srcs, count, nthreads)


def split_table_problem(world: int, table: list) -> Optional[str]:
    """Why every rank's all_to_all split table (2W + 6 entries a rank, as
    alltoall_splits publishes it) is wrong, or None: the core's verdict, the
    same words the shared-memory rounds raise."""
    return _native.split_table_problem(world, table)


def touch(addr: int, nbytes: int) -> None:
    """Store back one byte of every cache line, values unchanged (perf --fresh)."""
    _native.touch(addr, nbytes)


def time_memcpy(dst: int, src: int, nbytes: int, iters: int) -> float:
    """Seconds per memcpy of nbytes (the physical bound perf prints)."""
    return _native.time_memcpy(dst, src, nbytes, iters)


# op kinds, published with every round so that ranks calling different
# collectives are told so instead of corrupting each other (owned by the core:
# _native/tpcomm.h)
KIND_ALL_REDUCE = _native.KIND_ALL_REDUCE
KIND_BARRIER = _native.KIND_BARRIER
KIND_ALL_GATHER = _native.KIND_ALL_GATHER
KIND_REDUCE_SCATTER = _native.KIND_REDUCE_SCATTER
KIND_BROADCAST = _native.KIND_BROADCAST
KIND_GATHER = _native.KIND_GATHER
KIND_EMPTY = _native.KIND_EMPTY
KIND_ALL_TO_ALL = _native.KIND_ALL_TO_ALL
KIND_DUP = _native.KIND_DUP
KIND_REFUSED = _native.KIND_REFUSED
KIND_NAMES = {
    KIND_EMPTY: "empty",
    KIND_ALL_REDUCE: "all_reduce",
    KIND_BARRIER: "barrier",
    KIND_ALL_GATHER: "all_gather",
    KIND_REDUCE_SCATTER: "reduce_scatter",
    KIND_BROADCAST: "broadcast",
    KIND_GATHER: "gather",
    KIND_ALL_TO_ALL: "all_to_all",
    KIND_DUP: "dup",
    KIND_REFUSED: "refused",
}
_REDUCING = (KIND_ALL_REDUCE, KIND_REDUCE_SCATTER)

ST_OK = _native.ST_OK
ST_TIMEOUT = _native.ST_TIMEOUT
ST_PEER_DEAD = _native.ST_PEER_DEAD
ST_MISMATCH = _native.ST_MISMATCH
ST_ABORTED = _native.ST_ABORTED
ST_INTERRUPTED = _native.ST_INTERRUPTED
ST_CROSSED = _native.ST_CROSSED
ST_BUSY = _native.ST_BUSY
ST_CLOSED = _native.ST_CLOSED
ST_CMA = _native.ST_CMA
ST_PROTO = _native.ST_PROTO
ST_SPLITS = _native.ST_SPLITS

# How long close() waits for another thread's aborted call to leave the engine.
CLOSE_WAIT_S = 10.0


_ALGOS = {1: "one-shot", 2: "two-shot", _native.ARG_SINGLE_COPY: "single-copy"}


def _describe_call(kind: int, dtype: int, op: int, count: int, arg: int | None = None) -> str:
    name = KIND_NAMES.get(kind, f"op kind {kind}")
    if kind == KIND_BARRIER:
        return "barrier()"
    if kind == KIND_DUP:
        return "dup()"
    if kind in _REDUCING:
        dt = CODE_DTYPES.get(dtype, f"dtype code {dtype}")
        try:
            opname = ReduceOp(op).name
        except ValueError:
            opname = str(op)
        text = f"{name}(dtype={dt}, op={opname}, numel={count}"
    else:
        dt = ANY_CODE_DTYPES.get(dtype, f"dtype code {dtype}")
        text = f"{name}(dtype={dt}, numel={count}"
    if arg is None:
        return text + ")"
    if kind == KIND_ALL_REDUCE:
        if arg & 0xFF == _native.ARG_ZERO_COPY:
            pages, where = (arg >> 16) & 0xFFFF, f"in buffer {(arg >> 8) & 0xFF} at {arg >> 32}"
            pieces = f", in pieces of {pages * 4} KiB" if pages else ""
            return f"{text}, algorithm=zero-copy {where}{pieces})"
        # 0x80: a comm.empty tensor copied (zero copy measured slower: zerocopy.c)
        algo, pages = arg & 0x7F, arg >> 8
        how = ", copying a comm.empty tensor" if arg & 0x80 else ""
        if algo in (1, 2) and pages:  # chunk_bytes at a time
            return f"{text}, algorithm={_ALGOS[algo]} in chunks of {pages * 4} KiB{how})"
        return f"{text}, algorithm={_ALGOS.get(algo, arg)}{how})"
    if kind == KIND_BROADCAST:
        return f"{text}, src={arg})"
    return f"{text}, layout #{arg:016x})"


def _mismatch(fn: str, info: dict, me: int) -> str:
    """The ValueError of ranks that called different collectives: both calls."""
    mine = (info["my_kind"], info["my_dtype"], info["my_op"], info["my_count"])
    them = (info["kind"], info["dtype"], info["op"], info["count"])
    a, b = _describe_call(*mine), _describe_call(*them)
    if a == b:  # they differ in the algorithm, root or layout: say so
        a, b = _describe_call(*mine, info["my_arg"]), _describe_call(*them, info["arg"])
    return (
        f"{fn}: mismatched collective: rank {me} called {a} but rank {info['rank']} "
        f"called {b}; every rank must call the same collective with the same dtype, op, "
        f"element count, shape and root"
    )


_GONE = "this communicator can no longer be used"

# The exception of each status (raise_status): by status, or for an abort
# (ST_ABORTED) by (status, the reason the failing rank recorded, whether that
# rank is this one).  {me}: this rank; {peer}: the rank the core recorded (the
# one waited for, or the one that failed); {err}: the errno of a failed read.
_ERRORS: dict = {
    ST_SPLITS: (ValueError, "{text}"),
    ST_BUSY: (
        CommError,
        "another thread of rank {me} is inside a call on this Communicator; a "
        "Communicator serves one thread at a time (serialize the calls, or give each "
        "thread its own: comm.dup()); nothing was done and the Communicator is still usable",
    ),
    ST_MISMATCH: (  # KIND_REFUSED: the other mismatches name both calls (_mismatch)
        ValueError,
        "rank {peer} refused its own arguments to this call (its error says why) and "
        "told the others; nothing was done and the communicator is still usable",
    ),
    ST_PEER_DEAD: (
        PeerFailedError,
        "rank {peer} died or closed its communicator while rank {me} was waiting for it; " + _GONE,
    ),
    "timeout, any": (  # recv_any: nobody in particular
        CommTimeoutError,
        "Timed out after {timeout:g}s: rank {me} waited for a message from any rank and none came",
    ),
    ST_TIMEOUT: (
        CommTimeoutError,
        "Timed out after {timeout:g}s: rank {me} waited for rank {peer}, which is alive "
        "but never joined the collective (raise TPCOMM_TIMEOUT or the timeout= argument "
        "if that is expected)",
    ),
    ST_CROSSED: (
        CommError,
        "rank {me} waited for rank {peer} in a point-to-point send/recv while rank {peer} "
        "waited for this rank in a collective: the calls crossed and neither could go "
        "on; " + _GONE + " (every rank must call the collectives in the same order, and "
        "a recv needs a matching send)",
    ),
    ST_CMA: (
        CommError,
        "rank {me} could not read rank {peer}'s input from its memory (process_vm_readv: "
        "{err}), although it could when the communicator was created; "
        + _GONE
        + " (TPCOMM_CMA=0 makes all_gather, all_to_all and large sendrecv messages copy "
        "through shared memory)",
    ),
    ST_PROTO: (
        CommError,
        "rank {peer} sent rank {me} a point-to-point message whose lengths cannot be "
        "right (header or data size past the limits); nothing was read, and " + _GONE,
    ),
    (ST_ABORTED, ST_INTERRUPTED, False): (
        PeerFailedError,
        "rank {peer} was interrupted (a signal handler raised) during a collective of "
        "this communicator; it can no longer be used",
    ),
    (ST_ABORTED, ST_CROSSED, False): (
        CommError,
        "rank {peer} was waiting for this rank in a point-to-point send/recv while this "
        "rank waited in a collective: the calls crossed; " + _GONE,
    ),
    (ST_ABORTED, ST_CLOSED, True): (
        CommError,
        "another thread closed this Communicator (rank {me}) while the call was running",
    ),
    (ST_ABORTED, ST_CLOSED, False): (
        PeerFailedError,
        "rank {peer} closed its communicator while a call of it was running; " + _GONE,
    ),
    (ST_ABORTED, ST_CMA, False): (
        CommError,
        "rank {peer} could not read a peer's input from its memory (process_vm_readv) "
        "during an all_gather, all_to_all or sendrecv; " + _GONE + " (TPCOMM_CMA=0 avoids "
        "these reads)",
    ),
    (ST_ABORTED, ST_PROTO, False): (
        CommError,
        "rank {peer} sent a point-to-point message whose lengths cannot be right, and "
        "its receiver refused it; " + _GONE,
    ),
    (ST_ABORTED, ST_TIMEOUT, False): (
        CommTimeoutError,
        "rank {peer} timed out in a collective of this communicator; it can no longer be used",
    ),
    (ST_ABORTED, None, False): (
        PeerFailedError,
        "rank {peer} died or left during a collective of this communicator; it can no "
        "longer be used",
    ),
}


class ShmEngine:
    """One communicator's segment and the native engine that drives it (made
    by ``setup.open_engine``)."""

    def __init__(self, rank: int, world: int, timeout: float):
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.path = ""
        self._native: Any = None
        # Communicator.empty buffers by this rank's address (symmetric.py), how many
        # empty() calls there were (their ids), and those whose tensors are gone
        # but that the engine still lists (another thread was inside a call)
        self.symmetric: dict = {}
        self.sym_count = 0
        self._sym_dropped: list = []
        self.cma, self.cma_min = False, 0
        self.tuned: dict = {}

    # -- set-up (setup.py) -------------------------------------------------------

    def map(
        self,
        fd: int,
        slot_bytes: int,
        spin: float,
        settings: Settings,
        fixed_stores: bool,
        slot_moves: bool = True,
    ) -> None:
        """Map the segment (``fd``) with these settings (agreed: ``current``
        changes with adjust()).  ``slot_moves``: whether rounds of
        ``_native.SLOT_MOVE_MIN`` bytes or more move in the slots; rank 0's
        goes into the header, which the other ranks follow."""
        size = segment_size(self.world, slot_bytes)
        self.settings = settings
        if fixed_stores:  # nor the choice of zero copy: rank 0 times both as they run
            self.settings = self.settings._replace(nt_auto=False, zc_auto=False)
        self._native = _native.Engine(
            fd, size, self.rank, self.world, slot_bytes, self.rank == 0, self.timeout, spin,
            self.settings.yield_us, _native.SLOT_MOVE_MIN if slot_moves else -1,
        )  # fmt: skip
        # error details stay readable after close (a call another thread was
        # running when close() aborted it reports from here)
        self._errors = self._native
        self._validate(slot_bytes, size)
        self._apply(self.settings)

    def attach(self) -> None:
        self._native.attach()

    def attached(self, wait_s: float) -> bool:
        """Whether every rank mapped the segment, waiting up to ``wait_s``."""
        return self._native.wait_attached(wait_s)

    def ready(self, slot_bytes: int, tuned: dict) -> None:
        """Every rank mapped the segment: read its layout, bind the calls."""
        self.slot_bytes = slot_bytes
        self.tuned = tuned  # rank 0's profile, as every rank applied it
        lay = self._native.layout()
        self._base = self._native.address()
        self._slot_off = lay["slot_off"]
        self.p2p_bytes = lay["p2p_bytes"]
        self.p2p_ring = lay["p2p_ring"]  # chunks per point-to-point channel
        self._bind()

    def error_info(self) -> dict:
        """What the core recorded when a call failed (the peer, both calls)."""
        return self._errors.error_info()

    def _bind(self) -> None:
        """Bind the core's calls the callers make per collective: bound C methods,
        no Python frame in between (the hot path)."""
        n = self._native
        self.ident = id(n)  # custom_ops.py finds the communicator of a traced call by it
        self.all_reduce_raw = n.all_reduce
        self.fast_all_reduce = n.fast_all_reduce
        self.whole_all_gather_into_tensor = n.whole_all_gather_into_tensor
        self.whole_reduce_scatter_tensor = n.whole_reduce_scatter_tensor
        self.whole_gather = n.whole_gather
        self.fast_all_gather = n.fast_all_gather
        self.fast_gather = n.fast_gather
        self.fast_reduce_scatter = n.fast_reduce_scatter
        self.fast_all_to_all = n.fast_all_to_all
        self.fast_broadcast = n.fast_broadcast
        self.plain = n.plain
        self.sync = n.sync
        self.p2p_send_tensors = n.p2p_send_tensors
        self.p2p_recv = n.p2p_recv
        self.p2p_sendrecv = n.p2p_sendrecv
        self.p2p_wait_any = n.p2p_wait_any
        self.alltoall_splits = n.alltoall_splits
        self.alltoallv = n.alltoallv
        self.gatherv = n.gatherv
        self.reduce_scatterv = n.reduce_scatterv
        self.broadcast = n.broadcast
        self.message_header = n.message_header
        self.p2p_send = n.p2p_send
        self.p2p_batch = n.p2p_batch
        self.p2p_recv_head = n.p2p_recv_head
        self.p2p_recv_body = n.p2p_recv_body
        self.add_symmetric = n.add_symmetric

    def all_reduce(self, tensor: Any, op: ReduceOp) -> Any:
        """``tensor`` (checked: a CPU tensor of a dtype and op the engine does)
        reduced in place; a view goes through a dense copy."""
        work = dense(tensor)
        status = self.all_reduce_raw(
            work.data_ptr(), work.numel(), DTYPE_CODES[tensor.dtype], op.value, KIND_ALL_REDUCE
        )
        if status:
            self.raise_status(status, "all_reduce")
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def install_fast_paths(self, fallbacks: tuple) -> None:
        """Arm the one-call paths: the torch types they accept; Python's general
        paths (WeakMethods) for the rest of the calls the whole-call entries
        take, ``fallbacks``: all_reduce's (tensor, op), all_gather_into_tensor's
        (output, input), reduce_scatter_tensor's (output, input, op) and
        gather's (tensor, dst, dim, out=); and
        raise_status for the others' errors."""
        import torch

        self._native.set_fast_path(
            torch.Tensor,
            tuple(ReduceOp),
            tuple(CODE_DTYPES[i] for i in range(len(CODE_DTYPES))),
            KIND_ALL_REDUCE,
            tuple(fallbacks),
            weakref.WeakMethod(self.raise_status),
        )
        self._native.set_p2p_dtypes(tuple(ALL_DTYPES), layout.ANY_SIZE, torch.empty)

    def send_if_room(self, dst: int, pieces: list) -> Optional[int]:
        """Stream a message to dst only if the channel's ring takes it whole now:
        its status, or None (nothing sent)."""
        return self._native.p2p_send(dst, pieces, True)

    def abort(self) -> None:
        """Tell the peers this rank is gone (they raise PeerFailedError)."""
        if self._native is not None and not self.failed:
            self._native.abort(ST_PEER_DEAD)

    def rx_release(self) -> None:
        """Give up a received header whose body will not be read (no-op once read)."""
        if self._native is not None:
            self._native.rx_release()

    def algorithm(
        self, collective: str, nbytes: int, dtype: Any = None, symmetric: bool = False
    ) -> str:
        """How this engine does a plain call of ``collective`` moving ``nbytes``
        of ``dtype`` (all_reduce: its tensor, ``symmetric`` where it is from
        Communicator.empty; all_gather: the result): what tpcomm perf names.
        all_reduce: the C core's own choice (_native/allreduce.c ar_plan)."""
        if collective == "all_reduce":
            return self.all_reduce_plan(nbytes, dtype, symmetric)[0]
        if collective == "all_gather":
            return "single-copy" if self.cma and nbytes >= self.cma_min else "copy"
        return ""

    def all_reduce_plan(self, nbytes: int, dtype: Any = None, symmetric: bool = False) -> tuple:
        """(algorithm, chunk bytes, stores) of a plain all_reduce of ``nbytes``
        of ``dtype`` (default float32) now, as the C core runs it: the bytes it
        moves through the slots at a time (zero copy: of every rank's shard;
        0: everything at once), and the stores of its copies into them, "nt"
        (non-temporal) or "plain", as its chunks chose them so far
        (_native/allreduce.c) or nt_min fixes them ("": it copies nothing
        into the slots)."""
        import torch

        code = DTYPE_CODES[dtype if dtype is not None else torch.float32]
        return self._native.all_reduce_plan(nbytes, code, symmetric)

    def chunk(self, nbytes: int) -> int:
        """The bytes an all_reduce of ``nbytes`` moves through the slots at a
        time: a slot, or chunk_bytes from chunk_min bytes."""
        return self.all_reduce_plan(nbytes)[1]

    def stores_in_use(self, nbytes: int, dtype: Any = None) -> str:
        """The stores a plain all_reduce of ``nbytes`` of ``dtype`` copies
        into the slots with now ("nt", "plain", or "": none): what tpcomm perf
        names beside the algorithm."""
        return self.all_reduce_plan(nbytes, dtype)[2]

    # -- the settings in force (tpcomm tune times one algorithm against
    # -- another with these; the agreed ones are ``settings``) ----------------

    @property
    def threads(self) -> int:
        return self._native.threads

    @property
    def twoshot_min(self) -> int:
        return self.current.twoshot_min

    @property
    def twoshot_min16(self) -> int:
        return self.current.twoshot_min16

    @property
    def cma_ar_min(self) -> int:
        return self.current.cma_ar_min

    def adjust(self, **changes: Any) -> None:
        """Change this rank's settings (``Settings`` fields but cma_plan) until
        restore(): how tpcomm tune times one algorithm against another.  Ranks
        whose switch points differ get a mismatch error from the next call
        that they decide."""
        self._apply(self.current._replace(**changes))

    def agree_single_copy(self, want: bool, min_bytes: int) -> tuple[int, bool]:
        """Agree, collectively, whether single-copy reads are on: every rank can
        read every peer and wants them.  (status, on)."""
        two = self.twoshot_min if self.twoshot_min >= 0 else NEVER
        status, self.cma = self._native.cma_init(KIND_BARRIER, want, min_bytes, two)
        self.cma_min = min_bytes
        return status, self.cma

    def restore(self) -> None:
        """Back to the settings agreed at creation, single copy included
        (collective: every rank calls it together)."""
        self._apply(self.settings)
        self.agree_single_copy(*self.settings.cma_plan)

    # -- views for tests (tpcomm._testing) -------------------------------------

    @property
    def round(self) -> int:
        return self._native.round if self._native is not None else 0

    def nsymmetric(self) -> int:
        return self._native.nsymmetric()

    def set_waits(self, spin_us: float, yield_us: float, lost_us: float = 200.0) -> None:
        """How this rank's waits wait from now on: spin this long, then yield
        until ``yield_us``, then sleep (TPCOMM_SPIN_US and TPCOMM_YIELD_US at
        creation); a yield longer than ``lost_us`` lost the core, and the waits
        sleep instead of yielding for a while (_native/wait.c).  A rank's own:
        the peers need not agree."""
        self._native.set_waits(spin_us, yield_us, lost_us)

    def record(self, reset: bool = False, stamp: Optional[bool] = None) -> dict:
        """The core's record of rounds and waits (tpcomm.stats); ``reset`` clears
        it after reading, ``stamp`` turns the publishes' time stamps on or off."""
        return self._native.record(reset, -1 if stamp is None else int(stamp))

    def stores(self) -> dict:
        """What the all_reduce chunks learnt about their stores (_native/allreduce.c)."""
        return self._native.stores()

    def fault_stores(
        self, plain_us: float, nt_us: float, leftover_us: float = 0.0, chunks: int = 0
    ) -> None:
        self._native.fault_stores(plain_us, nt_us, leftover_us, chunks)

    def zero_copy_state(self) -> dict:
        """What rank 0's choice of zero copy or the copies learnt, and the
        choice in force per size (_native/zerocopy.c)."""
        return self._native.zero_copy_state()

    def fault_zero_copy(self, us: float) -> None:
        self._native.fault_zero_copy(us)

    def fault_check_delay(self, us: float) -> None:
        self._native.fault_check_delay(us)

    def fault_cma_addr(self, on: bool) -> None:
        self._native.fault_cma_addr(on)

    def layout(self) -> dict:
        return self._native.layout()

    def peer_pids(self) -> list:
        return self._native.peer_pids()

    def send_raw(self, dst: int, stream: bytes) -> Optional[int]:
        return self._native.p2p_send(dst, [stream])

    def _apply(self, s: Settings) -> None:
        """This rank's switch points and threads (not single copy:
        agree_single_copy)."""
        before = getattr(self, "current", None)
        self.current = s
        self._native.set_twoshot_min(s.twoshot_min)
        self._native.set_twoshot_min16(s.twoshot_min16)
        self._native.set_cma_allreduce_min(s.cma_ar_min)
        self._native.set_windows(s.twoshot_max, s.twoshot_max16, s.cma_ar_max, s.nt_max)
        self._native.set_zero_copy(s.zc_min, s.zc_max)
        self._native.set_chunks(s.chunk_min, s.chunk_bytes)
        if before is None or (before.threads, before.threads_min) != (s.threads, s.threads_min):
            self._native.set_threads(s.threads, s.threads_min)
        if before is None or before.nt_auto != s.nt_auto:
            self._native.set_stores_auto(s.nt_auto)
        if before is None or before.zc_auto != s.zc_auto:
            self._native.set_zero_copy_auto(s.zc_auto)
        self._native.set_nt_min(s.nt_min)
        self._native.set_populate_min(s.populate_min)

    def _validate(self, slot_bytes: int, size: int) -> None:
        h = self._native.header()
        expect = {
            "magic": _native.MAGIC,
            "version": _native.VERSION,
            "world": self.world,
            "slot_bytes": slot_bytes,
            "total_bytes": size,
            "nchan": _native.NCHAN,
            "p2p_bytes": self._native.layout()["p2p_bytes"],
        }
        for key, want in expect.items():
            if h[key] != want:
                raise CommError(
                    f"tpcomm: segment {self.path} has {key}={h[key]}, expected {want} "
                    f"(a different tpcomm version, or ranks that disagree on the world size)"
                )

    # -- errors ---------------------------------------------------------------

    def raise_status(self, status: int, fn: str) -> None:
        """Raise the exception for a non-zero status of the native core (the
        table _ERRORS; a mismatch names both sides' calls).  What went wrong
        (the peer, both sides' calls, the errno of a failed read) is what the
        core recorded when it failed (error_info)."""
        info = self._errors.error_info()
        peer = info.get("rank", -1)
        if status == ST_INTERRUPTED:
            self._native.reraise()  # KeyboardInterrupt or whatever the handler raised
        key: Any = status
        if status == ST_MISMATCH and info["kind"] != KIND_REFUSED:
            raise ValueError(_mismatch(fn, info, self.rank))
        if status == ST_TIMEOUT and peer == self.rank:
            key = "timeout, any"
        elif status == ST_ABORTED:
            key = (status, info.get("reason"), peer == self.rank)
            if key not in _ERRORS:
                key = (status, info.get("reason"), False)
            if key not in _ERRORS:
                key = (status, None, False)
        cls, text = _ERRORS.get(key, (CommError, "internal error, status {status}"))
        message = f"{fn}: " + text.format(
            me=self.rank, peer=peer, timeout=self.timeout, status=status,
            text=info.get("text", ""), err=os.strerror(info.get("errno") or 0),
        )  # fmt: skip
        if cls in (PeerFailedError, CommTimeoutError):
            raise cls(message, rank=peer)
        raise cls(message)

    # -- views of the segment --------------------------------------------------

    def slot_addr(self, rank: int, parity: int) -> int:
        """Address of rank's collective slot of this parity."""
        return self._base + self._slot_off + (rank * 2 + parity) * self.slot_bytes

    @property
    def failed(self) -> bool:
        return self._native is not None and self._native.failed

    def refuse(self) -> None:
        """One round that tells the peers this rank refused its arguments to the
        collective they are in (or call next): theirs ends in a ValueError naming
        this rank, at once, instead of a wait for it.  The round's own status is
        not this rank's concern: its caller raises its own error next."""
        if self._native is None:
            return
        try:
            self._native.sync(KIND_REFUSED, 0, 0, 0, 0)
        except Exception:  # noqa: BLE001  (closed meanwhile: nobody to tell)
            pass

    def hold(self, fn: str) -> None:
        """Keep the other threads out until release(): an operation of several
        native calls (each call checks on its own).  CommError if one is in."""
        if self._native is None:
            raise CommError(f"{fn}: the Communicator is closed")
        status = self._native.hold()
        if status:
            self.raise_status(status, fn)

    def release(self) -> None:
        if self._native is not None:
            self._native.release()

    def sym_dropped(self, base: int) -> None:
        """The tensors of the symmetric buffer at ``base`` are gone: reclaim it."""
        self._sym_dropped.append(base)
        self.reclaim()

    def reclaim(self) -> None:
        """Forget the symmetric buffers whose tensors are gone, and unmap them
        (those the engine cannot forget now, a call being inside it, wait)."""
        for base in list(self._sym_dropped):
            if self._native is not None and not self._native.remove_symmetric(base):
                continue
            self._sym_dropped.remove(base)
            self.symmetric.pop(base, None)

    @property
    def in_use(self) -> bool:
        """Whether another thread is inside a call on this engine, or holds it."""
        return self._native is not None and self._native.in_use

    def close(self) -> None:
        """Unmap.  A call another thread is running is aborted first (it raises
        CommError, the peers PeerFailedError) and close waits for it to leave."""
        if self._native is not None:
            self._native.close(CLOSE_WAIT_S)
            self._native = None
            self.all_reduce_raw = None
        # this rank's mappings of the empty() buffers (a tensor keeps its own)
        self.symmetric = {}
        self._sym_dropped = []

"""The shared-memory engine: a segment mapped by every rank, and its collectives.

The protocol itself (rounds, parity slots, publish/wait, liveness locks,
abort word) is documented at the top of ``_native/tpcomm.h``; this module sets it
up and turns the core's status codes into tpcomm's exceptions.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple, Optional

from .. import _env, _native, layout
from ..bootstrap import Watch, broadcast_from_rank0, death_explains, local_cpu_count
from ..errors import CommError, CommTimeoutError, PeerFailedError
from ..ops import (
    ALL_DTYPES,
    ANY_CODE_DTYPES,
    CODE_DTYPES,
    DTYPE_CODES,
    ReduceOp,
    dense,
)  # fmt: skip
from . import profile, segment

__all__ = [
    "KIND_ALL_REDUCE",
    "KIND_BARRIER",
    "KIND_NAMES",
    "MAGIC",
    "NativeEngine",
    "Settings",
    "ShmEngine",
    "engine_of",
    "isa_variants",
    "kernel_isa",
    "reduce_kernel",
    "select_kernels",
    "split_table_problem",
    "time_memcpy",
    "touch",
]

# The core's engine type (custom_ops.py traces its fast_all_reduce) and segment magic.
NativeEngine = _native.Engine
MAGIC = _native.MAGIC


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
        # 0x80: a comm.empty tensor copied (zero copy measured slower: allreduce.c)
        algo, pages = arg & 0x7F, arg >> 8
        how = ", copying a comm.empty tensor" if arg & 0x80 else ""
        if algo in (1, 2) and pages:  # chunk_bytes at a time
            return f"{text}, algorithm={_ALGOS[algo]} in chunks of {pages * 4} KiB{how})"
        return f"{text}, algorithm={_ALGOS.get(algo, arg)}{how})"
    if kind == KIND_BROADCAST:
        return f"{text}, src={arg})"
    return f"{text}, layout #{arg:016x})"


_NEVER = (1 << 64) - 1  # a switch point of -1 (never), as the core compares it


def _published_slot(text: str) -> int:
    """The slot size rank 0 published, checked (the store is not trusted)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not (4096 <= value <= _env.MAX_SLOT_BYTES and value % 4096 == 0):
        raise CommError(
            f"tpcomm: rank 0 published slot size {text!r}: refused (not a multiple of "
            f"4096 in [4096, {_env.MAX_SLOT_BYTES}])"
        )
    return value


def _settings_differ(info: dict, rank: int) -> str:
    """The ValueError of ranks whose switch points differ (cma_init's round)."""

    def show(v: int) -> str:
        return "never" if v == _NEVER else f"{v} bytes"

    peer, parts = info["rank"], []
    if info["my_count"] != info["count"]:
        parts.append(
            f"two-shot all_reduce from {show(info['my_count'])} on rank {rank} but from "
            f"{show(info['count'])} on rank {peer} (TPCOMM_ALLREDUCE_ALGO)"
        )
    if info["my_arg"] != info["arg"]:
        parts.append(
            f"single-copy reads from {show(info['my_arg'])} on rank {rank} but from "
            f"{show(info['arg'])} on rank {peer} (TPCOMM_CMA_MIN_BYTES, TPCOMM_CMA)"
        )
    return (
        "Communicator: the ranks' settings differ where they must agree: "
        + "; ".join(parts)
        + "; set them alike on every rank (nothing was made)"
    )


def engine_of(comm: Any) -> Optional[ShmEngine]:
    """The shared-memory engine of a Communicator (None: world size 1, across
    hosts, closed): how tpcomm tune, tpcomm perf and the tests reach it."""
    shm = getattr(comm, "_shm", None)
    return None if shm is None else shm.engine


class Settings(NamedTuple):
    """The engine's settings (settings_for)."""

    nt_min: int  # copies into a slot of this many bytes use non-temporal stores (-1: never)
    nt_auto: bool  # all_reduce chunks of 4 KiB and more choose their stores as they run
    yield_us: float  # how long a wait yields before it sleeps
    threads: int  # threads per rank
    threads_min: int  # the smallest job they share (-1: never)
    twoshot_min: int  # all_reduce two-shot from (float32 and the integers)
    twoshot_min16: int  # the same for bfloat16 and float16
    cma_ar_min: int  # all_reduce single-copy from (-1: never)
    cma_min: int  # all_gather (and all_to_all) single-copy from (-1: never)
    cma: bool  # single-copy reads allowed at all (TPCOMM_CMA)
    zc_min: int  # all_reduce of a comm.empty tensor: zero-copy from (-1: never)
    zc_max: int  # up to (-1: no limit)
    chunk_min: int  # all_reduce through the slots chunk_bytes at a time from (-1: never)
    chunk_bytes: int  # that chunk (the others go a slot at a time)
    zc_auto: bool = True  # rank 0 chooses zero copy or the copies as calls run

    @property
    def cma_plan(self) -> tuple:
        """cma_init's arguments: (single-copy reads wanted, all_gather's switch
        point); wanted where some collective would use them."""
        want = self.cma and (self.cma_min >= 0 or self.cma_ar_min >= 0)
        return want, self.cma_min if self.cma_min >= 0 else _NEVER


def settings_for(world: int, slot: int, tuned: Optional[dict] = None) -> Settings:
    """The engine's settings, each checked.  ``tuned``: rank 0's profile
    (shm/profile.py), used where this rank's environment does not set it."""
    tuned = tuned or {}

    def pick(key: str, default: int) -> int:
        env = profile.SETTINGS[key]
        return default if key not in tuned or _env.explicit(env) else tuned[key]

    two = pick("twoshot_min_bytes", _env.twoshot_min_bytes(world))
    chunk = pick("chunk_bytes", _env.chunk_bytes(slot)) // 4096 * 4096  # a profile's too
    return Settings(
        nt_min=pick("nt_min_bytes", _env.nt_min_bytes()),
        nt_auto=_env.nt_auto(),
        yield_us=_env.yield_us(),
        threads=_env.threads(world),
        threads_min=pick("threads_min_bytes", _env.threads_min_bytes()),
        twoshot_min=two,
        twoshot_min16=pick("twoshot_min_bytes_16bit", two),  # 16-bit: as the rest by default
        cma_ar_min=pick("cma_allreduce_min_bytes", _env.cma_allreduce_min_bytes()),
        cma_min=pick("cma_min_bytes", _env.cma_min_bytes(world)),
        cma=_env.cma(),
        zc_min=pick("zero_copy_min_bytes", _env.zero_copy_min_bytes()),
        zc_max=pick("zero_copy_max_bytes", _env.zero_copy_max_bytes()),
        chunk_min=pick("chunk_min_bytes", _env.chunk_min_bytes()),
        chunk_bytes=min(max(4096, chunk), slot),
    )


class ShmEngine:
    """One communicator's segment and the native engine that drives it."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        prefix: str,
        group_tag: str,
        timeout: float,
        watch: Optional[Watch] = None,
    ):
        self.rank = rank
        self.world = world
        self.timeout = timeout
        # Every setting is read (and checked) before anything exists: a bad value
        # raises the same error on every rank at once, none waits for another.
        slot_bytes = _env.slot_bytes()
        select_kernels()
        tuning = settings_for(world, slot_bytes)
        # rank 0's tuned profile (tpcomm tune), sent to the others with the segment
        self.tuned = profile.settings(world) if rank == 0 else {}
        # Ranks that outnumber the cores gain nothing by spinning: the peer they
        # wait for needs the core.  (Pinned ranks see one CPU; count the host's.)
        oversubscribed = world > max(local_cpu_count(), os.cpu_count() or 1)
        spin = 0.0 if oversubscribed else _env.spin_us()
        # nor can rank 0 time its copies there: the cores' other ranks preempt
        # them, so the stores stay as TPCOMM_NT_MIN_BYTES says (docs/DECISIONS.md)
        fixed_stores = oversubscribed
        # Every rank must agree on the layout: rank 0 decides it, writes the
        # header, and only then publishes the path (with the slot size).
        self.path = ""
        self._native = None
        # Communicator.empty buffers by this rank's address (symmetric.py), how many
        # empty() calls there were (their ids), and those whose tensors are gone
        # but that the engine still lists (another thread was inside a call)
        self.symmetric: dict = {}
        self.sym_count = 0
        self._sym_dropped: list = []
        fd = -1
        try:
            if rank == 0:
                try:
                    tuning = settings_for(world, slot_bytes, self.tuned)
                    self.path, fd = segment.create(world, slot_bytes, group_tag)
                    self._map(fd, world, slot_bytes, spin, timeout, tuning, fixed_stores)
                except CommError as e:
                    broadcast_from_rank0(store, prefix, 0, "segment", "!" + str(e), timeout, watch)
                    raise
                # the slot size and the name's random token only: the peers
                # derive the path themselves (the store is not trusted)
                token = segment.token_of(self.path)
                told = f"{slot_bytes}:{token}:{profile.encode(self.tuned)}"
                broadcast_from_rank0(store, prefix, 0, "segment", told, timeout, watch)
            else:
                value = broadcast_from_rank0(store, prefix, rank, "segment", None, timeout, watch)
                try:
                    slot_text, _, rest = value.partition(":")
                    token, _, tuned_text = rest.partition(":")
                    slot_bytes = _published_slot(slot_text)
                    try:
                        self.tuned = profile.decode(tuned_text)
                    except ValueError as e:
                        raise CommError(str(e)) from None
                    tuning = settings_for(world, slot_bytes, self.tuned)
                    path = segment.derive(group_tag, token)
                    fd = segment.open_existing(path, world, slot_bytes)
                except CommError as e:  # tell the others, who wait for this rank to attach
                    store.set(f"{prefix}/attach-failed", f"rank {rank}: {e}")
                    raise
                self.path = path  # checked: from here on, this rank may unlink it
                self._map(fd, world, slot_bytes, spin, timeout, tuning, fixed_stores)
            os.close(fd)
            fd = -1
            self._native.attach()
            ok = self._wait_attached(store, prefix, timeout, watch)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            if self.path:
                segment.unlink_quietly(self.path)
            self.close()
            raise
        # All ranks mapped it (or the wait gave up): nobody needs the name now.
        segment.unlink_quietly(self.path)
        if not ok:
            self.close()
            raise CommTimeoutError(
                f"tpcomm: only some of the {world} ranks attached to the segment within "
                f"{timeout:g}s; the others are missing or were started with a different world size"
            )
        self.slot_bytes = slot_bytes
        lay = self._native.layout()
        self._base = self._native.address()
        self._slot_off = lay["slot_off"]
        self.p2p_bytes = lay["p2p_bytes"]
        self.p2p_ring = lay["p2p_ring"]  # chunks per point-to-point channel
        self._bind()
        # exchange nothing more through the store: drop the reference
        del store
        # single-copy all_gather: on when every rank can read every other one
        self.cma, self.cma_min = False, 0
        if world > 1:
            status, _ = self.cma_init(*tuning.cma_plan)
            if status == ST_MISMATCH:  # the ranks' settings differ: say which, on every rank
                info = self._errors.error_info()
                self.close()
                raise ValueError(_settings_differ(info, rank))
            if status:
                self.close()
                self.raise_status(status, "Communicator")

    def _wait_attached(
        self, store: Any, prefix: str, timeout: float, watch: Optional[Watch] = None
    ) -> bool:
        """Wait until every rank mapped the segment; a rank that could not (it
        runs as another user, the file failed its checks) says so in the store,
        and then every rank raises its CommError at once instead of timing out."""
        key = f"{prefix}/attach-failed"
        deadline = time.monotonic() + timeout
        while True:
            if self._native.wait_attached(min(0.05, max(deadline - time.monotonic(), 0.0))):
                return True
            try:
                failed = store.check([key])
            except Exception as e:  # the store is gone (the rank hosting it died?)
                if watch is not None:
                    death_explains(watch, "every rank to attach to the segment")
                raise CommError(
                    f"tpcomm: the set-up store failed while ranks attached: {e}"
                ) from None
            if failed:
                why = store.get(key).decode()
                raise CommError(
                    f"tpcomm: {why} (this is rank {self.rank}, uid {os.getuid()}: every rank "
                    f"must run as the same user and see the same {_env.shm_dir()})"
                )
            if watch is not None:
                watch.check("every rank to attach to the segment")
            if time.monotonic() >= deadline:
                return False

    def _bind(self) -> None:
        """Bind the core's calls the callers make per collective: bound C methods,
        no Python frame in between (the hot path)."""
        n = self._native
        self.ident = id(n)  # custom_ops.py finds the communicator of a traced call by it
        self.all_reduce_raw = n.all_reduce
        self.fast_all_reduce = n.fast_all_reduce
        self.fast_all_gather = n.fast_all_gather
        self.fast_gather = n.fast_gather
        self.fast_reduce_scatter = n.fast_reduce_scatter
        self.fast_all_to_all = n.fast_all_to_all
        self.fast_broadcast = n.fast_broadcast
        self.plain = n.plain
        self.sync = n.sync
        self.p2p_send_tensors = n.p2p_send_tensors
        self.p2p_recv_new = n.p2p_recv_new
        self.p2p_sendrecv = n.p2p_sendrecv
        self.p2p_wait_any = n.p2p_wait_any
        self.alltoall_splits = n.alltoall_splits
        self.alltoallv = n.alltoallv
        self.gatherv = n.gatherv
        self.reduce_scatterv = n.reduce_scatterv
        self.broadcast = n.broadcast
        self.message_header = n.message_header

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

    def install_fast_paths(self, fallback: Any) -> None:
        """Arm the one-call paths: the torch types they accept, and Python's general
        path (``fallback(tensor, op, status)``, a WeakMethod) for the rest."""
        import torch

        self._native.set_fast_path(
            torch.Tensor,
            tuple(ReduceOp),
            tuple(CODE_DTYPES[i] for i in range(len(CODE_DTYPES))),
            KIND_ALL_REDUCE,
            fallback,
        )
        self._native.set_p2p_dtypes(tuple(ALL_DTYPES), layout.ANY_SIZE, torch.empty)

    def cma_init(self, want: bool, min_bytes: int) -> tuple[int, bool]:
        """Agree, collectively, whether single-copy reads are on: every rank can
        read every peer and wants them.  (status, on)."""
        two = self.twoshot_min if self.twoshot_min >= 0 else _NEVER
        status, self.cma = self._native.cma_init(KIND_BARRIER, want, min_bytes, two)
        self.cma_min = min_bytes
        return status, self.cma

    def send_if_room(self, dst: int, pieces: list) -> Optional[int]:
        """Stream a message to dst only if the channel's ring takes it whole now:
        its status, or None (nothing sent)."""
        return self._native.p2p_send(dst, pieces, True)

    def abort(self) -> None:
        """Tell the peers this rank is gone (they raise PeerFailedError)."""
        if self._native is not None and not self.failed:
            self._native.abort(ST_PEER_DEAD)

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

    # -- knobs and views for tests (tpcomm._testing) -------------------------

    @property
    def round(self) -> int:
        return self._native.round if self._native is not None else 0

    @property
    def threads(self) -> int:
        return self._native.threads

    # the switch points in force (retune changes them; settings: as agreed)
    @property
    def twoshot_min(self) -> int:
        return self.current.twoshot_min

    @property
    def twoshot_min16(self) -> int:
        return self.current.twoshot_min16

    @property
    def cma_ar_min(self) -> int:
        return self.current.cma_ar_min

    def retune(self, **changes: Any) -> None:
        """Change this rank's settings (``Settings`` fields but cma_plan) until
        restore(): how tpcomm tune times one algorithm against another, and
        tests force one.  Ranks whose switch points differ get a mismatch
        error from the next call that they decide."""
        self._apply(self.current._replace(**changes))

    def restore(self) -> None:
        """Back to the settings agreed at creation, single copy included
        (collective: every rank calls it together)."""
        self._apply(self.settings)
        self.cma_init(*self.settings.cma_plan)

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

    def fault_stores(self, plain_us: float, nt_us: float) -> None:
        self._native.fault_stores(plain_us, nt_us)

    def zero_copy_state(self) -> dict:
        """What rank 0's choice of zero copy or the copies learnt, and the
        choice in force per size (_native/allreduce.c)."""
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

    def _map(
        self,
        fd: int,
        world: int,
        slot_bytes: int,
        spin: float,
        timeout: float,
        tuning: Optional[tuple] = None,
        fixed_stores: bool = False,
    ) -> None:
        size = segment.segment_size(world, slot_bytes)
        # as agreed (retune changes current)
        self.settings = tuning or settings_for(world, slot_bytes)
        if fixed_stores:  # nor the choice of zero copy: rank 0 times both as they run
            self.settings = self.settings._replace(nt_auto=False, zc_auto=False)
        self._native = _native.Engine(
            fd, size, self.rank, world, slot_bytes, self.rank == 0, timeout, spin,
            self.settings.yield_us,
        )  # fmt: skip
        # error details stay readable after close (a call another thread was
        # running when close() aborted it reports from here)
        self._errors = self._native
        self._validate(slot_bytes, size)
        self._apply(self.settings)

    def _apply(self, s: Settings) -> None:
        """This rank's switch points and threads (not single copy: cma_init)."""
        before = getattr(self, "current", None)
        self.current = s
        self._native.set_twoshot_min(s.twoshot_min)
        self._native.set_twoshot_min16(s.twoshot_min16)
        self._native.set_cma_allreduce_min(s.cma_ar_min)
        self._native.set_zero_copy(s.zc_min, s.zc_max)
        self._native.set_chunks(s.chunk_min, s.chunk_bytes)
        if before is None or (before.threads, before.threads_min) != (s.threads, s.threads_min):
            self._native.set_threads(s.threads, s.threads_min)
        if before is None or before.nt_auto != s.nt_auto:
            self._native.set_stores_auto(s.nt_auto)
        if before is None or before.zc_auto != s.zc_auto:
            self._native.set_zero_copy_auto(s.zc_auto)
        self._native.set_nt_min(s.nt_min)

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
        """Raise the exception for a non-zero status of the native core.  What
        went wrong (the peer, both sides' calls on a mismatch, the errno of a
        failed read) is what the core recorded when it failed (error_info)."""
        info = self._errors.error_info()
        peer = info.get("rank", -1)
        if status == ST_SPLITS:  # every rank read the same table: the same verdict
            raise ValueError(f"{fn}: {info['text']}")
        if status == ST_BUSY:
            raise CommError(
                f"{fn}: another thread of rank {self.rank} is inside a call on this "
                f"Communicator; a Communicator serves one thread at a time (serialize the "
                f"calls, or give each thread its own: comm.dup()); nothing was done and "
                f"the Communicator is still usable"
            )
        if status == ST_MISMATCH and info["kind"] == KIND_REFUSED:
            raise ValueError(
                f"{fn}: rank {peer} refused its own arguments to this call (its error says "
                f"why) and told the others; nothing was done and the communicator is still "
                f"usable"
            )
        if status == ST_MISMATCH:
            me = (info["my_kind"], info["my_dtype"], info["my_op"], info["my_count"])
            them = (info["kind"], info["dtype"], info["op"], info["count"])
            mine, theirs = _describe_call(*me), _describe_call(*them)
            if mine == theirs:  # they differ in the algorithm, root or layout: say so
                mine = _describe_call(*me, info["my_arg"])
                theirs = _describe_call(*them, info["arg"])
            raise ValueError(
                f"{fn}: mismatched collective: rank {self.rank} called {mine} but rank {peer} "
                f"called {theirs}; every rank must call the same collective with the same "
                f"dtype, op, element count, shape and root"
            )
        if status == ST_PEER_DEAD:
            raise PeerFailedError(
                f"{fn}: rank {peer} died or closed its communicator while rank {self.rank} "
                f"was waiting for it; this communicator can no longer be used",
                rank=peer,
            )
        if status == ST_TIMEOUT and peer == self.rank:  # recv_any: nobody in particular
            raise CommTimeoutError(
                f"{fn}: Timed out after {self.timeout:g}s: rank {self.rank} waited for a "
                f"message from any rank and none came",
                rank=peer,
            )
        if status == ST_TIMEOUT:
            raise CommTimeoutError(
                f"{fn}: Timed out after {self.timeout:g}s: rank {self.rank} waited for rank "
                f"{peer}, which is alive but never joined the collective (raise "
                f"TPCOMM_TIMEOUT or the timeout= argument if that is expected)",
                rank=peer,
            )
        if status == ST_CROSSED:
            raise CommError(
                f"{fn}: rank {self.rank} waited for rank {peer} in a point-to-point "
                f"send/recv while rank {peer} waited for this rank in a collective: the "
                f"calls crossed and neither could go on; this communicator can no longer "
                f"be used (every rank must call the collectives in the same order, and a "
                f"recv needs a matching send)"
            )
        if status == ST_CMA:
            raise CommError(
                f"{fn}: rank {self.rank} could not read rank {peer}'s input from its memory "
                f"(process_vm_readv: {os.strerror(info['errno'])}), although it could when "
                f"the communicator was created; this communicator can no longer be used "
                f"(TPCOMM_CMA=0 makes all_gather, all_to_all and large sendrecv messages "
                f"copy through shared memory)"
            )
        if status == ST_PROTO:
            raise CommError(
                f"{fn}: rank {peer} sent rank {self.rank} a point-to-point message whose "
                f"lengths cannot be right (header or data size past the limits); nothing "
                f"was read, and this communicator can no longer be used"
            )
        if status == ST_INTERRUPTED:
            self._native.reraise()  # KeyboardInterrupt or whatever the handler raised
        if status == ST_ABORTED:
            reason = info.get("reason")
            if reason == ST_INTERRUPTED:
                raise PeerFailedError(
                    f"{fn}: rank {peer} was interrupted (a signal handler raised) during a "
                    f"collective of this communicator; it can no longer be used",
                    rank=peer,
                )
            if reason == ST_CROSSED:
                raise CommError(
                    f"{fn}: rank {peer} was waiting for this rank in a point-to-point "
                    f"send/recv while this rank waited in a collective: the calls crossed; "
                    f"this communicator can no longer be used"
                )
            if reason == ST_CLOSED and peer == self.rank:
                raise CommError(
                    f"{fn}: another thread closed this Communicator (rank {self.rank}) "
                    f"while the call was running"
                )
            if reason == ST_CLOSED:
                raise PeerFailedError(
                    f"{fn}: rank {peer} closed its communicator while a call of it was "
                    f"running; this communicator can no longer be used",
                    rank=peer,
                )
            if reason == ST_CMA:
                raise CommError(
                    f"{fn}: rank {peer} could not read a peer's input from its memory "
                    f"(process_vm_readv) during an all_gather, all_to_all or sendrecv; "
                    f"this communicator can no longer be used (TPCOMM_CMA=0 avoids these "
                    f"reads)"
                )
            if reason == ST_PROTO:
                raise CommError(
                    f"{fn}: rank {peer} sent a point-to-point message whose lengths cannot "
                    f"be right, and its receiver refused it; this communicator can no "
                    f"longer be used"
                )
            if reason == ST_TIMEOUT:
                raise CommTimeoutError(
                    f"{fn}: rank {peer} timed out in a collective of this communicator; "
                    f"it can no longer be used",
                    rank=peer,
                )
            raise PeerFailedError(
                f"{fn}: rank {peer} died or left during a collective of this communicator; "
                f"it can no longer be used",
                rank=peer,
            )
        raise CommError(f"{fn}: internal error, status {status}")

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

"""Communicator: the public API.

Every public method reads the same way: where one exists, the one-call C
entry of the shared-memory path for the common case (``shm/path.py``,
``_native/torch.c`` and ``coll_tensors.c``: the measured hot path); else
the argument checks (``checks.py``, which raise before anything is
touched), then ``routing.route`` over this communicator's paths, then that
path's method (``paths.Path``: every path has the same methods).  How a Communicator is
made, and which paths it gets, is ``construction.py``.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Optional, Sequence

import torch

from . import checks, construction, custom_ops, routing, stats
from .errors import CommError
from .ops import ReduceOp, is_dense
from .paths import NOT_PLAIN, Path

__all__ = ["Communicator"]

_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling

Timeout = checks.Timeout

# the Calls of the collectives whose routing depends on nothing else (made
# once: a NamedTuple costs about 0.4 us to make on a VM)
_PLAIN_CALLS = {k: routing.Call(k) for k in ("barrier", "broadcast", "empty", "p2p", "all_to_all")}

# how many fork()s this process descends through: a Communicator keeps the
# count it was made under, so a child made by fork() finds its parent's
# different (_check_open) without asking the kernel for its pid on every call
# (os.getpid is a system call: about 0.5 us on a VM)
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


class Communicator:
    """Collectives between the processes of one group, through shared memory.

    Create it on every rank of a group, in the same order on every rank:

    * ``Communicator(group)`` inside a torch.distributed job (any backend; the
      group's store is used for set-up only), ``group=None`` for the world;
    * ``Communicator.from_env()`` with no torch.distributed: reads RANK,
      WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them;
    * ``tpcomm.launch(fn, world_size)`` spawns local ranks and hands each one.

    Every method is collective: all ranks call it, in the same order, with the
    same dtype and element count.  A rank that calls something else gets a
    ``ValueError`` naming both calls (and so does every other rank).  Results
    are bitwise identical on every rank.  A dead peer raises
    ``PeerFailedError`` on every survivor, never a hang.

    Args:
        group: the torch.distributed process group (default: the world).
        timeout: seconds (or a timedelta) any wait may last while the peers
            are alive; default ``TPCOMM_TIMEOUT`` (300 s).
    """

    def __init__(self, group: Any = None, *, timeout: Timeout = None):
        seconds = checks.timeout_seconds("Communicator", timeout)
        self._setup(construction.group_setup(group, seconds))

    @classmethod
    def from_env(cls, *, timeout: Timeout = None) -> Communicator:
        """Create a communicator from torchrun-style environment variables.

        Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  Rank 0 hosts a
        TCPStore on MASTER_ADDR:MASTER_PORT for the set-up (under torchrun,
        whose agent already serves one there, every rank connects to it).
        """
        seconds = checks.timeout_seconds("Communicator.from_env", timeout)
        return cls._made(construction.env_setup(seconds))

    @classmethod
    def from_store(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        *,
        prefix: str = "tpcomm",
        timeout: Timeout = None,
        fallback: Any = None,
        cuda_fallback: Any = None,
    ) -> Communicator:
        """Create a communicator over an existing torch ``Store`` (collective: every
        rank calls it with the same ``prefix``, which keeps communicators made over
        one store apart).

        Args:
            fallback: the torch.distributed path for what the engine does not do
                (a ``tpcomm.dist_path.DistPath``); default: a private gloo
                group over ``store``, made on first use.
            cuda_fallback: the path CUDA all-reduces take when the custom
                all-reduce declines them; default: a private NCCL group.
        """
        seconds = checks.timeout_seconds("Communicator.from_store", timeout)
        return cls._made(
            construction.Setup(
                store, rank, world_size, prefix, prefix.replace("/", "-"), seconds,
                fallback=fallback, cuda_fallback=cuda_fallback,
            )
        )  # fmt: skip

    @classmethod
    def _made(cls, s: construction.Setup) -> Communicator:
        """A Communicator from a set-up (the launcher's, a hierarchy's host-local
        ones, whose segment tag and watch their maker chose)."""
        self = cls.__new__(cls)
        self._setup(s)
        return self

    def _setup(self, s: construction.Setup) -> None:
        self._op_name = ""
        self._rank = s.rank
        self._world = s.world
        self._pid = os.getpid()  # a child made by fork() cannot use it (_check_open)
        self._forks = _forks[0]
        self._timeout = s.timeout
        self._setup_args = s  # dup() makes the next one over the same store
        self._closed = False
        self._dups = 0
        self._shm = None
        self._fast: Path = Path()  # no one-call entries until the paths exist
        self._paths: list[Path] = []
        self._routes: dict[routing.Call, routing.Route] = {}  # _path's
        cls = type(self)

        def make_local(r: int, w: int, p: str, members: list, watch: Any) -> Communicator:
            sub = watch.sub(s.store, p, members, r)
            return cls._made(
                construction.Setup(s.store, r, w, p, f"{s.tag}h", s.timeout, watch=sub)
            )

        # what the whole-call entries hand the calls they do not take to (the
        # last three: the class's own methods, which check and name themselves)
        fallbacks = (
            weakref.WeakMethod(self._all_reduce_checked),
            weakref.WeakMethod(cls.all_gather_into_tensor.__get__(self)),
            weakref.WeakMethod(cls.reduce_scatter_tensor.__get__(self)),
            weakref.WeakMethod(cls.gather.__get__(self)),
        )
        made = construction.build(self, s, make_local, fallbacks)
        self._paths = made.order
        # the views the properties and dup() read; the calls go through _fast
        # (the path whose one-call C entries are tried first: shared memory's,
        # or a Path whose entries decline) and routing (_path)
        self._shm = made.shm
        self._hier = made.hier
        self._dist = made.dist
        self._watch = made.watch
        self._fast = made.fast
        if made.shm is not None:
            # The instance attributes shadow the methods below: one C call per
            # call in the common case, the rest handed to the fallbacks
            # (_native/torch.c fast_all_reduce, coll_tensors.c whole_call).
            self.all_reduce = made.shm.fast_all_reduce
            self.all_gather_into_tensor = made.shm.whole_all_gather_into_tensor
            self.reduce_scatter_tensor = made.shm.whole_reduce_scatter_tensor
            self.gather = made.shm.whole_gather
        self._op_name = custom_ops.register(self, self._fast.ident)
        self._final_stats = None
        stats.start(self, self._fast)

    # -- properties -----------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the communicator."""
        return self._world

    @property
    def closed(self) -> bool:
        """True once close() was called."""
        return self._closed

    @property
    def shared_memory(self) -> bool:
        """True when this communicator's CPU collectives run through shared memory
        (world size 2 or more, every rank on this host)."""
        return self._shm is not None

    @property
    def single_copy(self) -> bool:
        """True when large all_gathers, all_to_alls and exchanged messages read the
        peers' memory directly (every rank may; TPCOMM_CMA, docs/COLLECTIVES.md)."""
        return self._shm is not None and self._shm.single_copy

    @property
    def spans_hosts(self) -> bool:
        """True when the ranks are on several hosts (served hierarchically)."""
        return self._hier is not None

    def __repr__(self) -> str:
        failed = self._fast.failed
        state = "closed" if self._closed else ("failed" if failed else "open")
        return f"<tpcomm.Communicator rank={self._rank} world_size={self._world} {state}>"

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment.  Idempotent; local (not collective).

        Peers still waiting on this rank afterwards get PeerFailedError.  Called
        while another thread is inside a call on this Communicator, it aborts that
        call (which raises CommError; the peers get PeerFailedError) and returns
        once the call has left, within milliseconds: how a watchdog thread
        stops a collective that hangs.
        """
        if self._closed:
            return
        if not self._fast.failed and self._fast.record() is not None:
            self._final_stats = self.stats()
            stats.finish(self, self._final_stats)
        self._closed = True
        # a call another thread is running is aborted first and close waits for
        # it to leave (ShmEngine.close); if it does not, nothing else changes
        try:
            self._fast.close()
        except BaseException:
            self._closed = False
            raise
        custom_ops.unregister(self)
        self.__dict__.pop("all_reduce", None)
        for path in self._paths:  # shared memory's again: idempotent
            path.close()
        # the set-up store: no longer needed (one this rank hosts for from_env
        # stays up for the next from_env of this process: construction._hosted)
        self._setup_args = None
        self._shm = self._dist = None
        self._fast = Path()
        self._paths = []
        self._routes = {}

    def stats(self, reset: bool = False) -> dict:
        """This rank's record of rounds and waits: how many rounds of each
        collective, how many waits found the peer there and how the others
        ended (spinning, yielding, asleep), the time they took, and with
        ``TPCOMM_STATS`` set, how late this rank saw its peers' publishes
        (``tpcomm.stats`` says what each field means).  Not collective.
        ``reset`` starts the counts again.  After close(): the record at close.
        Without shared memory (world size 1, across hosts): rank and world only."""
        if self._closed:
            return self._final_stats or {"rank": self._rank, "world_size": self._world}
        record = self._fast.record(reset)
        if record is None:
            return {"rank": self._rank, "world_size": self._world}
        return stats.shape(record, self._rank, self._world)

    def dup(self, *, timeout: Timeout = None) -> Communicator:
        """A new Communicator over the same ranks (collective: every rank calls it,
        in the same order), with shared memory, sequence numbers and channels of
        its own.

        A Communicator serves one thread at a time; a second thread that must
        communicate at the same time (a pipeline stage's sender, a background
        prefetch) gets its own ``dup()`` and both run at once.  Also a way to keep
        two streams of calls apart.  ``timeout`` defaults to this one's.
        """
        fn = "dup"
        self._check_open(fn)
        seconds = self._timeout if timeout is None else checks.timeout_seconds(fn, timeout)
        self._fast.dup_round(fn)
        self._dups += 1
        s = self._setup_args
        prefix = f"{s.prefix}/dup{self._dups}"
        watch = None
        if self._watch is not None:  # the same processes: their records are known
            watch = self._watch.sub(s.store, prefix, list(range(self._world)), self._rank)
        return type(self)._made(
            construction.Setup(
                s.store, self._rank, self._world, prefix, f"{s.tag}d{self._dups}", seconds,
                s.group, s.fallback, watch=watch,
            )
        )  # fmt: skip

    def __reduce__(self) -> Any:
        raise TypeError(
            "Communicator cannot be pickled or copied: it is this process's mapping of "
            "shared memory; create one in each process (Communicator(group), "
            "Communicator.from_env(), or tpcomm.launch)"
        )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- argument checks and the choice of path --------------------------------

    @contextlib.contextmanager
    def _own_checks(self):
        """The checks of how this rank's arguments fit together, which may fail
        on one rank alone (its tensor against the sizes, its output against its
        input: sizes that come from data): a TypeError or ValueError raised
        inside comes after one round that tells the peers (ShmEngine.refuse), so
        theirs, in the same collective, raise a ValueError naming this rank
        instead of waiting for it until the timeout.  Nothing inside may have
        started a round.  What every rank's code gets wrong alike (a quantized
        tensor, a bad op) stays outside: raised at once, no round."""
        try:
            yield
        except (TypeError, ValueError):
            self._fast.refuse()
            raise

    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise CommError(f"{fn}: the Communicator is closed")
        if self._forks != _forks[0]:
            raise CommError(
                f"{fn}: this Communicator belongs to process {self._pid}; a child made by "
                f"fork() cannot use its parent's Communicator (make a new one in the child)"
            )

    def _path(self, fn: str, call: routing.Call) -> Any:
        """This call's path (routing.route over this communicator's paths); a
        call leaving for torch.distributed is logged once, with why.  Kept per
        Call: the paths and their objections do not change while the
        communicator is open, and routing anew cost about 2 us a call, more
        than the round of a barrier."""
        try:
            r = self._routes.get(call)
        except TypeError:  # an op that cannot be hashed: routed every time
            r = routing.route(self._paths, call)
        else:
            if r is None:
                r = self._routes[call] = routing.route(self._paths, call)
        if r.reason:  # passed over shared memory (or the hierarchy): torch.distributed
            self._dist.note(fn, r.reason)
        return r.via

    # -- reductions -------------------------------------------------------------

    def all_reduce(self, tensor: _Tensor, op: ReduceOp = ReduceOp.SUM) -> _Tensor:
        """Reduce ``tensor`` across all ranks, in place.

        After the call ``tensor`` is bitwise identical on every rank, and the
        same on every repetition: values are combined in rank order 0..W-1,
        floating types in float32 (bfloat16 and float16 round once).

        Args:
            tensor: a CPU tensor (float32, bfloat16, float16, int32, int64),
                any shape and size, contiguous or not.
            op: ReduceOp.SUM (default), AVG (floating only), MAX or MIN.

        Returns:
            ``tensor``.
        """
        if _compiling():
            return custom_ops.all_reduce(self, tensor, op)
        return self._all_reduce_checked(tensor, op)

    def _all_reduce_checked(self, tensor: Any, op: Any) -> _Tensor:
        fn = "all_reduce"
        self._check_open(fn)
        call = checks.all_reduce_call(fn, tensor, op)
        return self._path(fn, call).all_reduce(tensor, call.op)

    def reduce_scatter(self, tensor: _Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM) -> _Tensor:
        """This rank's shard of the reduction: the reduction of every rank's
        ``tensor``, split in world_size equal parts along ``dim``, part ``rank``."""
        if _compiling():
            return custom_ops.reduce_scatter(self, tensor, dim, op)
        fn = "reduce_scatter"
        self._check_open(fn)
        op = checks.reduce_op(fn, tensor, op)
        d = checks.dim(fn, tensor, dim)
        part = checks.divided(fn, tensor, d, self._world)
        return self._reduce_scatterv(fn, tensor, [part] * self._world, d, op)

    def reduce_scatterv(
        self, tensor: _Tensor, sizes: Sequence[int], dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> _Tensor:
        """Like reduce_scatter with uneven parts: rank r gets ``sizes[r]`` entries along
        ``dim`` (any may be 0; they must add up to the tensor's size)."""
        fn = "reduce_scatterv"
        self._check_open(fn)
        op = checks.reduce_op(fn, tensor, op)
        d = checks.dim(fn, tensor, dim)
        with self._own_checks():
            sizes = checks.sizes(fn, sizes, self._world, tensor, d)
        return self._reduce_scatterv(fn, tensor, sizes, d, op)

    def reduce_scatter_tensor(
        self, output: _Tensor, input: _Tensor, op: ReduceOp = ReduceOp.SUM
    ) -> _Tensor:
        """torch-style: ``output`` gets this rank's part of the reduction of every rank's
        ``input`` (world_size x output's elements, flattened).  Returns ``output``."""
        if _compiling():
            return custom_ops.reduce_scatter_tensor(self, output, input, op)
        if self._fast.fast_reduce_scatter(output, input, op):  # one C call
            return output
        fn = "reduce_scatter_tensor"
        self._check_open(fn)
        op = checks.reduce_op(fn, input, op)
        checks.tensor(fn, output, "output")
        checks.writable(fn, output, "output")
        with self._own_checks():
            checks.same_dtype(fn, output, input)
            checks.world_times(fn, input, "input", output, "output", self._world)
        sizes = [output.numel()] * self._world
        res = self._reduce_scatterv(fn, input.reshape(-1), sizes, 0, op)
        output.copy_(res.view(output.shape))
        return output

    def _reduce_scatterv(self, fn: str, tensor: _Tensor, sizes: list, d: int, op: Any) -> _Tensor:
        call = routing.Call("reduce_scatter", dtype=tensor.dtype, op=op)
        return self._path(fn, call).reduce_scatterv(fn, tensor, sizes, d, op)

    # -- gathers ----------------------------------------------------------------

    def all_gather(self, tensor: _Tensor, dim: int = 0) -> _Tensor:
        """All ranks' ``tensor`` concatenated along ``dim`` (same shape on every rank).

        Returns:
            A new tensor, bitwise identical on every rank.
        """
        if _compiling():
            return custom_ops.all_gather(self, tensor, dim)
        fn = "all_gather"
        # the common case (a plain tensor, an int dim): one C check, the same rounds
        # and layout key as the general road, ~8 us less per call; 1-d: one C
        # call, as all_gather_into_tensor (the same key)
        if type(dim) is int and dim == 0 and type(tensor) is _Tensor and tensor.dim() == 1:
            out = torch.empty(self._world * tensor.shape[0], dtype=tensor.dtype)
            if self._fast.fast_all_gather(out, tensor, fn):
                return out
        res = self._fast.fast_gather_dim(fn, tensor, dim, None, None)
        if res is not NOT_PLAIN:
            return res
        self._check_open(fn)
        checks.tensor(fn, tensor)
        d = checks.dim(fn, tensor, dim)
        return self._gatherv(fn, tensor, [tensor.shape[d]] * self._world, d, None)

    def all_gatherv(self, tensor: _Tensor, sizes: Sequence[int], dim: int = 0) -> _Tensor:
        """Like all_gather, but rank r contributes ``sizes[r]`` entries along ``dim``
        (any of them may be 0); the other dims must agree."""
        fn = "all_gatherv"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        d = checks.dim(fn, tensor, dim)
        with self._own_checks():
            sizes = checks.sizes(fn, sizes, self._world, tensor, d, self._rank)
        return self._gatherv(fn, tensor, sizes, d, None)

    def gather(
        self, tensor: _Tensor, dst: int = 0, dim: int = 0, *, out: Optional[_Tensor] = None
    ) -> Optional[_Tensor]:
        """All ranks' ``tensor`` concatenated along ``dim`` on rank ``dst``; None elsewhere.

        ``out`` (used on ``dst``, ignored elsewhere): a tensor of the result's shape
        and dtype to gather into, which saves allocating (and first-touching) the
        result on every call; it is returned.  An ``out`` that does not fit is
        detected on ``dst`` only, so the gather still completes (into a temporary,
        the peers are not left waiting) and then ``dst`` raises ``ValueError``.
        """
        fn = "gather"
        # the common case (a plain tensor, a fitting out= or none); 1-d: one C call
        # (fast_gather, the same layout key)
        if (
            type(tensor) is _Tensor
            and tensor.dim() == 1
            and type(dim) is int
            and (dim == 0 or dim == -1)
            and (out is None or (type(out) is _Tensor and out.dim() == 1))
        ):
            res = out if self._rank == dst else None
            if res is None and self._rank == dst:
                res = torch.empty(self._world * tensor.shape[0], dtype=tensor.dtype)
            if self._fast.fast_gather(tensor, res, dst):
                return res
        res = self._fast.fast_gather_dim(fn, tensor, dim, dst, out)
        if res is not NOT_PLAIN:
            return res
        self._check_open(fn)
        checks.tensor(fn, tensor)
        dst = checks.rank(fn, "dst", dst, self._world)
        d = checks.dim(fn, tensor, dim)
        sizes = [tensor.shape[d]] * self._world
        # an out that does not fit is found on dst only: the gather completes
        # (into a temporary), then dst raises
        bad = checks.gather_out(fn, out, tensor, d, self._world) if self._rank == dst else None
        if out is not None and bad is None and self._rank == dst and is_dense(out):
            return self._gatherv(fn, tensor, sizes, d, dst, out=out)
        res = self._gatherv(fn, tensor, sizes, d, dst)
        if self._rank != dst:
            return None
        if bad is not None:
            raise type(bad)(f"{bad} (the gather itself completed; out is untouched)")
        return res if out is None else out.copy_(res)

    def all_gather_into_tensor(self, output: _Tensor, input: _Tensor) -> _Tensor:
        """torch-style: ``output`` (world_size x input's elements, same dtype) gets every
        rank's ``input`` in rank order, flattened along dim 0.  Returns ``output``."""
        if _compiling():
            return custom_ops.all_gather_into_tensor(self, output, input)
        # the common case (plain tensors, output = world x input): one C call with
        # the general road's metadata; None: the general road, which checks all
        if self._fast.fast_all_gather(output, input):
            return output
        fn = "all_gather_into_tensor"
        self._check_open(fn)
        checks.tensor(fn, output, "output")
        checks.writable(fn, output, "output")
        checks.tensor(fn, input, "input")
        with self._own_checks():
            checks.same_dtype(fn, output, input)
            checks.world_times(fn, output, "output", input, "input", self._world)
        sizes = [input.numel()] * self._world
        into = output if is_dense(output) else None
        res = self._gatherv(fn, input.reshape(-1), sizes, 0, None, out=into)
        if res is not output:
            output.copy_(res.view(output.shape))
        return output

    def all_gather_into_list(self, outputs: Sequence[_Tensor], tensor: _Tensor) -> list:
        """torch's list form: ``outputs[r]`` gets rank r's ``tensor`` (every output
        has ``tensor``'s dtype and element count; shapes may differ).  Returns
        ``outputs``."""
        return self._gather_list("all_gather_into_list", outputs, tensor, None)

    def gather_into_list(
        self, outputs: Optional[Sequence[_Tensor]], tensor: _Tensor, dst: int = 0
    ) -> Optional[list]:
        """torch's list form of gather: on ``dst``, ``outputs[r]`` gets rank r's
        ``tensor``; elsewhere ``outputs`` is ignored (may be None) and None comes
        back."""
        return self._gather_list("gather_into_list", outputs, tensor, dst)

    def _gather_list(
        self, fn: str, outputs: Any, tensor: _Tensor, root: Optional[int]
    ) -> Optional[list]:
        self._check_open(fn)
        checks.tensor(fn, tensor)
        if root is not None:
            root = checks.rank(fn, "dst", root, self._world)
        mine = root is None or root == self._rank
        outs: list = [None] * self._world
        if mine:
            with self._own_checks():  # the root's alone in gather_into_list
                outs = checks.output_list(fn, outputs, self._world, tensor.numel())
        kind = "gather" if root is not None else "all_gather"
        path = self._path(fn, routing.Call(kind, rooted=root is not None))
        path.gather_list(fn, outs, tensor, root)
        return list(outputs) if mine else None

    def _gatherv(
        self,
        fn: str,
        tensor: _Tensor,
        sizes: list,
        d: int,
        root: Optional[int],
        out: Optional[_Tensor] = None,
    ) -> Optional[_Tensor]:
        kind = "gather" if root is not None else "all_gather"
        call = routing.Call(kind, rooted=root is not None, even=len(set(sizes)) == 1)
        return self._path(fn, call).gatherv(fn, tensor, sizes, d, root, out)

    def broadcast(self, tensor: _Tensor, src: int = 0) -> _Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place; returns it."""
        if _compiling():
            return custom_ops.broadcast(self, tensor, src)
        if self._fast.fast_broadcast(tensor, src):  # a plain tensor: one C call
            return tensor
        fn = "broadcast"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        checks.writable(fn, tensor)
        src = checks.rank(fn, "src", src, self._world)
        return self._path(fn, _PLAIN_CALLS[fn]).broadcast(fn, tensor, src)

    def scatter(
        self, tensor: _Tensor, parts: Optional[Sequence[_Tensor]] = None, src: int = 0
    ) -> _Tensor:
        """``tensor`` gets ``parts[rank]`` of rank ``src`` (each part has
        ``tensor``'s dtype and element count); ``parts`` is read on ``src`` only.
        Returns ``tensor``.  Collective."""
        fn = "scatter"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        checks.writable(fn, tensor)
        src = checks.rank(fn, "src", src, self._world)
        if self._rank == src:
            parts = checks.input_list(fn, parts, self._world)
        return self._path(fn, _PLAIN_CALLS["p2p"]).scatter(fn, tensor, parts, src)

    def all_to_all_single(
        self,
        output: _Tensor,
        input: _Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
    ) -> _Tensor:
        """torch-style all-to-all along dim 0 (MoE token dispatch and combine).

        Rank r's input rows ``input_split_sizes[j]`` (after the rows it sends to
        ranks before j) go to rank j, which puts them at its output rows after
        those of ranks before r (``output_split_sizes[r]`` rows).  Without split
        sizes the rows are cut evenly (divisible by the world size).  Split sizes
        may change every call; every rank's are checked against every other
        rank's first, so bad ones raise the same ``ValueError`` on every rank and
        the communicator stays usable.  Any dtype; output and input share it and
        the shape of a row.  Returns ``output``.
        """
        # the common case (plain tensors of one dtype, split sizes None or lists of
        # ints): one C call with the rounds and split table of the general road
        if self._fast.fast_all_to_all(output, input, output_split_sizes, input_split_sizes):
            return output
        fn = "all_to_all_single"
        self._check_open(fn)
        checks.tensor(fn, output, "output")
        checks.writable(fn, output, "output")
        checks.tensor(fn, input, "input")
        outs = checks.splits(fn, "output_split_sizes", output_split_sizes)
        ins = checks.splits(fn, "input_split_sizes", input_split_sizes)
        self._path(fn, _PLAIN_CALLS["all_to_all"]).all_to_all(fn, output, input, outs, ins)
        return output

    def barrier(self) -> None:
        """Return once every rank has called barrier()."""
        fn = "barrier"
        self._check_open(fn)
        self._path(fn, _PLAIN_CALLS[fn]).barrier(fn)

    def empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> _Tensor:
        """A new (uninitialised) tensor that lives in shared memory.  Collective.

        Every rank calls it with the same shape and dtype.  An all_reduce of such
        a tensor (at the same place on every rank) reads the peers' tensors where
        they are instead of copying them in first; every other use is a normal
        CPU tensor.  The memory stays valid as long as the tensor lives, and
        nothing is left in the shm directory.
        """
        fn = "empty"
        self._check_open(fn)
        shape = checks.shape(fn, shape, dtype)
        return self._path(fn, _PLAIN_CALLS[fn]).empty(fn, shape, dtype)

    def peer_buffers(self, tensor: _Tensor) -> list[_Tensor]:
        """For a tensor made by ``empty()``: every rank's copy of its shared buffer,
        as uint8 tensors mapped in this process (rank order), which this process
        may read and write (symmetric memory: a kernel can address any rank's
        copy).  Not collective.  World size 1 or across hosts: ``[buffer]``, this
        rank's own memory only."""
        fn = "peer_buffers"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        return self._fast.peer_buffers(fn, tensor)

    # -- point to point -----------------------------------------------------------

    def send(self, tensors: Sequence[_Tensor], dst: int) -> None:
        """Send a list of tensors (any count, shapes and dtypes) to rank ``dst``.

        Not collective: only ``dst`` calls ``recv(src=this rank)``.  Messages from one
        rank to another arrive in order; ``send`` returns as soon as the data is in
        shared memory; it waits only while the channel to ``dst`` is full (a ring of 64
        chunks holding 2 x slot bytes / world size, at least 128 KiB; a message takes
        at least one chunk) with messages ``dst`` has not received yet.
        """
        if self._fast.fast_send(dst, tensors):  # plain tensors: one C call
            return
        fn = "send"
        self._check_open(fn)
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        self._path(fn, _PLAIN_CALLS["p2p"]).send(fn, dst, tensors, None)

    def recv(self, src: int, out: Optional[Sequence[_Tensor]] = None) -> list[_Tensor]:
        """Receive the next list of tensors rank ``src`` sent to this rank.

        Args:
            src: the sending rank.
            out: optional contiguous tensors of the message's dtypes and shapes to
                receive into (saves allocating, and first-touching, new memory).
                A message that does not match is received and then raises
                ``ValueError``.
        """
        fn = "recv"
        got = self._fast.fast_recv(src, out)  # one C call: new tensors, or into out
        if type(got) is list:
            return got
        if got is not None:  # a header the C call left to Python (pickled, or not out's)
            return self._fast.recv_rest(fn, src, out, got)
        self._check_open(fn)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        out = checks.recv_out(fn, out)
        return self._path(fn, _PLAIN_CALLS["p2p"]).recv(fn, src, out)[0]

    def recv_any(self, out: Optional[Sequence[_Tensor]] = None) -> tuple[int, list[_Tensor]]:
        """Receive the next message from whichever rank's arrives first.

        Returns ``(src, tensors)``.  Messages from one rank still arrive in the
        order it sent them; among ranks with one waiting, the search starts after
        the last rank received this way, so none starves.  ``out`` as in
        ``recv``.  Shared memory only (one host): across hosts, ``CommError``.
        """
        fn = "recv_any"
        self._check_open(fn)
        out = checks.recv_out(fn, out)
        return self._path(fn, _PLAIN_CALLS["p2p"]).recv_any(fn, out)

    def sendrecv(
        self,
        tensors: Sequence[_Tensor],
        dst: int,
        src: int,
        out: Optional[Sequence[_Tensor]] = None,
    ) -> list[_Tensor]:
        """Send ``tensors`` to ``dst`` and receive the next message from ``src``,
        both moving at once (MPI_Sendrecv): when every rank calls it, no pattern
        and no size can deadlock (a shift around a ring, an exchange between
        pairs), which a ``send`` then ``recv`` on every rank can once a message
        exceeds the channel's ring.  ``dst`` and ``src`` may be the same rank.

        Args:
            out: optional contiguous tensors to receive into, as for ``recv``;
                without them the message lands in new tensors.

        Returns:
            The received tensors (``out``'s when given).
        """
        fn = "sendrecv"
        got = self._fast.fast_sendrecv(dst, tensors, src, out)  # plain tensors: one C call
        if type(got) is list:
            return got
        if got is not None:  # no out, or it did not match: received aside
            return self._fast.sendrecv_rest(fn, src, out, *got)
        self._check_open(fn)
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        if out is not None:
            out = checks.tensor_list(fn, out, written=True)
        return self._path(fn, _PLAIN_CALLS["p2p"]).sendrecv(fn, tensors, dst, src, out)

    def try_send(self, tensors: Sequence[_Tensor], dst: int) -> bool:
        """Send ``tensors`` to ``dst`` only if that takes no waiting (the channel
        holds the whole message now): True when sent, False when nothing was
        (then ``send`` or ``batch_isend_irecv`` it).  Plain CPU tensors through
        shared memory only; anything else is never sent here."""
        fn = "try_send"
        self._check_open(fn)
        return self._path(fn, _PLAIN_CALLS["p2p"]).try_send(fn, dst, tensors)

    def batch_isend_irecv(self, ops: Sequence[tuple]) -> list:
        """Sends and receives progressed together, so that no order of them can
        deadlock (torch's ``batch_isend_irecv``): each op is ``("send", tensors,
        dst)`` or ``("recv", tensors, src)``.  A receive lands in its tensors when
        the message has their count and, tensor by tensor, their dtype and element
        count (shapes may differ, as with gloo).

        Returns:
            One entry per op: None, or the exception of a receive whose message did
            not fit (it was received and dropped; the channel stays in step).  A
            failure of the communicator itself (a dead peer) raises.
        """
        fn = "batch_isend_irecv"
        self._check_open(fn)
        checked = checks.p2p_ops(fn, ops, self._world, self._rank)
        return self._path(fn, _PLAIN_CALLS["p2p"]).batch(fn, checked)

    def send_tensor_dict(self, data: dict, dst: int) -> None:
        """Send a dict whose values are tensors or any picklable Python values."""
        fn = "send_tensor_dict"
        self._check_open(fn)
        checks.tensor_dict(fn, data)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        self._path(fn, _PLAIN_CALLS["p2p"]).send_dict(fn, dst, data)

    def recv_tensor_dict(self, src: int) -> dict:
        """Receive the next dict sent with send_tensor_dict by rank ``src``."""
        fn = "recv_tensor_dict"
        self._check_open(fn)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        return self._path(fn, _PLAIN_CALLS["p2p"]).recv_dict(fn, src)

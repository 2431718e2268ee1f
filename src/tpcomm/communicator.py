"""Communicator: argument checks, the choice of path per call, error mapping.

Every public collective starts with a fast check that recognises the common
case (a contiguous CPU tensor of a supported dtype) and goes straight to the
native engine; anything else goes through the full checks in ``_checked``,
which raise before anything is touched.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pickle
import weakref
from typing import Any, Optional, Sequence

import torch

from . import _env, checks, compiled, layout, routing
from .bootstrap import Watch, exchange, host_identity, master_store
from .dist_fallback import DistPath, private_gloo, private_nccl
from .errors import CommError
from .hierarchical import Hierarchy
from .ops import (
    DTYPE_CODES,
    ReduceOp,
    as_reduce_op,
    dense,
    is_dense,
)
from .shm import protocols, symmetric
from .shm.engine import (
    KIND_ALL_GATHER,
    KIND_ALL_TO_ALL,
    KIND_BARRIER,
    KIND_BROADCAST,
    KIND_DUP,
    KIND_GATHER,
    KIND_REDUCE_SCATTER,
    ShmEngine,
    split_table_problem,
)

__all__ = ["Communicator"]

_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_STRIDED = torch.strided

# Communicators created on the same ranks get the same sequence number on
# every rank because every rank creates them in the same order (a collective
# contract, as in torch.distributed.new_group).
_created: collections.Counter = collections.Counter()

Timeout = checks.Timeout

# the set-up stores this process hosts for from_env, by (MASTER_ADDR, MASTER_PORT)
_hosted: dict = {}


_NOT_PLAIN = object()  # _plain_gather: not its case
# marks the messages of scatter, so that one of them is never taken for a
# user's send (and the other way round)
_SCATTER = "tpcomm.scatter"


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
        import torch.distributed as dist

        fn = "Communicator"
        seconds = checks.timeout_seconds(fn, timeout)
        if not (dist.is_available() and dist.is_initialized()):
            raise CommError(
                f"{fn}: torch.distributed is not initialized; call "
                f"dist.init_process_group(...) first, or use Communicator.from_env() or "
                f"tpcomm.launch()"
            )
        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"{fn}: this process (global rank {dist.get_rank()}) is not a "
                f"member of the given group"
            )
        world = dist.get_world_size(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        tag = hashlib.sha1(repr(ranks).encode()).hexdigest()[:8]
        _created[tag] += 1
        prefix = f"tpcomm/g{tag}/{_created[tag]}"
        store = dist.distributed_c10d._get_default_store()
        # a rank's process record also under its global rank: a later
        # communicator of the same processes sees a rank that died before it
        # got that far (bootstrap.Watch)
        also = {r: f"tpcomm/proc/{g}" for r, g in enumerate(ranks)}
        watch = Watch.over(store, prefix, rank, world, also)
        self._setup(store, rank, world, prefix, f"g{tag}", seconds, group, watch=watch)

    @classmethod
    def from_env(cls, *, timeout: Timeout = None) -> Communicator:
        """Create a communicator from torchrun-style environment variables.

        Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  Rank 0 hosts a
        TCPStore on MASTER_ADDR:MASTER_PORT for the set-up (under torchrun,
        whose agent already serves one there, every rank connects to it).
        """
        from torch.distributed import TCPStore

        fn = "Communicator.from_env"
        seconds = checks.timeout_seconds(fn, timeout)
        env = {}
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            value = os.environ.get(name)
            if not value:
                raise ValueError(
                    f"{fn}: environment variable {name} is not set (torchrun sets "
                    f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                )
            env[name] = value
        try:
            rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        except ValueError:
            raise ValueError(
                f"{fn}: RANK, WORLD_SIZE and MASTER_PORT must be integers, got {env}"
            ) from None
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"{fn}: RANK={rank} must be in [0, WORLD_SIZE={world})")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = None
        if world > 1 and rank == 0 and not agent:  # listening on MASTER_ADDR only
            # one per address and port for the life of the process: a communicator
            # made again after close() uses it again (peers may still be
            # connected to it; a new one on the same port would cut them off)
            key = (env["MASTER_ADDR"], port)
            store = _hosted.get(key)
            if store is None:
                store = _hosted[key] = master_store(env["MASTER_ADDR"], port, world, seconds)
        elif world > 1:
            store = TCPStore(
                env["MASTER_ADDR"],
                port,
                world,
                is_master=False,
                timeout=_env.timedelta(seconds),
                wait_for_workers=False,
            )
        _created["env"] += 1
        self = cls.__new__(cls)
        prefix = f"tpcomm/env/{_created['env']}"
        also = {r: f"tpcomm/env/proc/{r}" for r in range(world)}
        watch = Watch.over(store, prefix, rank, world, also)
        self._setup(store, rank, world, prefix, "env", seconds, watch=watch)
        return self

    @classmethod
    def from_store(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        *,
        prefix: str = "tpcomm",
        timeout: Timeout = None,
        fallback: Optional[DistPath] = None,
        cuda_fallback: Optional[DistPath] = None,
    ) -> Communicator:
        """Create a communicator over an existing torch ``Store`` (collective: every
        rank calls it with the same ``prefix``, which keeps communicators made over
        one store apart).

        Args:
            fallback: the torch.distributed path for what the engine does not do
                (a ``tpcomm.dist_fallback.DistPath``); default: a private gloo
                group over ``store``, made on first use.
            cuda_fallback: the path CUDA all-reduces take when the custom
                all-reduce declines them; default: a private NCCL group.
        """
        return cls._from_store(
            store, rank, world_size, prefix, prefix.replace("/", "-"), timeout,
            fallback=fallback, cuda_fallback=cuda_fallback,
        )  # fmt: skip

    @classmethod
    def _from_store(
        cls,
        store: Any,
        rank: int,
        world: int,
        prefix: str,
        tag: str,
        timeout: Timeout = None,
        fallback: Optional[DistPath] = None,
        cuda_fallback: Optional[DistPath] = None,
        watch: Optional[Watch] = None,
    ) -> Communicator:
        """from_store with the segment's name tag chosen by the caller (the
        launcher's, a hierarchy's host-local communicators, whose ``watch``
        knows its ranks' processes already)."""
        self = cls.__new__(cls)
        seconds = checks.timeout_seconds("Communicator", timeout)
        self._setup(
            store, rank, world, prefix, tag, seconds, fallback=fallback,
            cuda_fallback=cuda_fallback, watch=watch,
        )  # fmt: skip
        return self

    def _setup(self, *args: Any, **kwargs: Any) -> None:
        self._op_name = ""
        self._setup_paths(*args, **kwargs)
        self._op_name = compiled.register(self)

    def _setup_paths(
        self,
        store: Any,
        rank: int,
        world: int,
        prefix: str,
        tag: str,
        timeout: float,
        group: Any = None,
        fallback: Optional[DistPath] = None,
        cuda_fallback: Optional[DistPath] = None,
        watch: Optional[Watch] = None,
    ) -> None:
        self._rank = rank
        self._world = world
        self._pid = os.getpid()  # a child made by fork() cannot use it (_check_open)
        self._timeout = timeout
        self._group = group
        self._engine: Optional[ShmEngine] = None
        self._hier: Optional[Hierarchy] = None
        self._closed = False
        # the torch.distributed path, for what the engine does not do: the
        # caller's (the backend's private gloo), the group's, or else a private
        # gloo group over the set-up store, made on first use (see dist_fallback.py)
        self._store = store
        self._prefix = prefix
        self._tag = tag
        self._fallback = fallback
        self._dups = 0
        self._cuda_ar: dict = {}  # device -> tpcomm.cuda.CustomAllreduce, made on first use
        # NCCL, for what the custom path declines (the caller's, or made on first use)
        self._cuda_dist: Optional[DistPath] = cuda_fallback
        self._dist: Optional[DistPath] = None
        if world > 1:
            if fallback is not None:
                self._dist = fallback
            elif group is not None:
                self._dist = DistPath(group, rank, world)
            else:
                self._dist = DistPath(
                    lambda: private_gloo(store, f"{prefix}/gloo", rank, world, timeout),
                    rank,
                    world,
                    label="gloo, tpcomm's own",
                )
        # the paths a call may take, in the order routing.route tries them
        self._paths: list = [routing.LOCAL]
        self._watch: Optional[Watch] = None
        if world == 1:
            return
        # before any wait: the peers can tell this rank died (bootstrap.Watch)
        if watch is None:
            watch = Watch.over(store, prefix, rank, world)
        self._watch = watch
        watch.publish()
        # the host and the process: the second lets the watch check every peer
        # from here on, even once the store is gone (its host, rank 0, died)
        mine = f"{host_identity()}\n{watch.known[rank]}"
        both = exchange(store, prefix, rank, world, "host", mine, timeout, watch)
        hosts = [v.rpartition("\n")[0] for v in both]
        watch.known.update((r, v.rpartition("\n")[2]) for r, v in enumerate(both))
        if len(set(hosts)) != 1:
            cls = type(self)

            def make_local(r: int, w: int, p: str, members: list) -> Communicator:
                sub = watch.sub(store, p, members, r)
                return cls._from_store(store, r, w, p, f"{tag}h", timeout, watch=sub)

            self._hier = Hierarchy(make_local, store, prefix, rank, world, hosts, timeout)
            self._paths = [routing.CUDA, self._hier, self._dist]
            return
        self._engine = ShmEngine(store, rank, world, prefix, tag, timeout, watch)
        self._paths = [routing.CUDA, self._engine, self._dist]
        # send/recv's common case in C too (p2p_send_tensors, p2p_recv_into)
        self._engine.install_fast_paths(weakref.WeakMethod(self._all_reduce_fallback))
        # The instance attribute shadows the method below: one C call per
        # all_reduce in the common case (_native/torch.c fast_all_reduce).
        self.all_reduce = self._engine.fast_all_reduce

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
        return self._engine is not None

    @property
    def single_copy(self) -> bool:
        """True when large all_gathers, all_to_alls and exchanged messages read the
        peers' memory directly (every rank may; TPCOMM_CMA, docs/COLLECTIVES.md)."""
        return self._engine is not None and self._engine.cma

    @property
    def spans_hosts(self) -> bool:
        """True when the ranks are on several hosts (served hierarchically)."""
        return self._hier is not None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failed() else "open")
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
        self._closed = True
        if self._engine is not None:
            # a call another thread is running is aborted first and close waits for
            # it to leave (ShmEngine.close); if it does not, nothing else changes
            try:
                self._engine.close()
            except BaseException:
                self._closed = False
                raise
            self._engine = None
        self.__dict__.pop("all_reduce", None)
        compiled.unregister(self)
        for car in self._cuda_ar.values():
            car.close()
        self._cuda_ar.clear()
        self._cuda_dist = None  # a caller's (the backend's) path: its owner releases it
        # the set-up store: no longer needed (one this rank hosts for from_env
        # stays up for the next from_env of this process: _hosted)
        self._store = None
        self._dist = None
        self._paths = []
        if self._hier is not None:
            self._hier.close()

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
        if self._engine is not None:
            # one round first, like any collective: a rank that called something
            # else meets a mismatch here at once (on every rank), instead of this
            # rank waiting in the set-up store for the whole timeout
            status = self._engine.sync(KIND_DUP, 0, 0, 0, 0)
            if status:
                self._raise(status, fn)
        self._dups += 1
        other = type(self).__new__(type(self))
        prefix = f"{self._prefix}/dup{self._dups}"
        watch = None
        if self._watch is not None:  # the same processes: their records are known
            watch = self._watch.sub(self._store, prefix, list(range(self._world)), self._rank)
        other._setup(
            self._store, self._rank, self._world, prefix, f"{self._tag}d{self._dups}",
            seconds, self._group, self._fallback, watch=watch,
        )  # fmt: skip
        return other

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

    def _failed(self) -> bool:
        return self._engine is not None and self._engine.failed

    # -- argument checks (one place) ------------------------------------------

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
            if self._engine is not None:
                self._engine.refuse()
            raise

    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise CommError(f"{fn}: the Communicator is closed")
        if self._pid != os.getpid():
            raise CommError(
                f"{fn}: this Communicator belongs to process {self._pid}; a child made by "
                f"fork() cannot use its parent's Communicator (make a new one in the child)"
            )

    # -- the choice of path ----------------------------------------------------

    def _route(self, fn: str, call: routing.Call) -> str:
        """The name of this call's path (``_path``)."""
        return self._path(fn, call).path

    def _path(self, fn: str, call: routing.Call) -> routing.Route:
        """The path of this call (routing.route over this communicator's paths);
        a call leaving for torch.distributed is logged once, with why."""
        r = routing.route(self._paths, call)
        if r.path == "dist":
            self._dist.note(fn, r.reason)
        return r

    # -- collectives ----------------------------------------------------------

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
            return compiled.all_reduce(self, tensor, op)
        return self._all_reduce_checked(tensor, op)

    def _all_reduce_fallback(self, tensor: Any, op: Any, status: int) -> _Tensor:
        """Called by the native fast path for everything it does not handle."""
        if status:
            self._raise(status, "all_reduce")
        return self._all_reduce_checked(tensor, op)

    def _all_reduce_checked(self, tensor: Any, op: Any) -> _Tensor:
        fn = "all_reduce"
        self._check_open(fn)
        if isinstance(tensor, _Tensor) and tensor.is_cuda:
            return self._cuda_all_reduce(tensor, op)
        if isinstance(tensor, _Tensor) and tensor.is_sparse and tensor.is_cpu:
            # sparse: torch.distributed's (gloo sums sparse tensors), in place
            op = as_reduce_op(fn, op)
            return tensor if self._dist is None else self._dist.all_reduce_sparse(tensor, op)
        op = checks.reduce_op(fn, tensor, op)
        checks.writable(fn, tensor)
        # every path has the same all_reduce(tensor, op)
        path = self._path(fn, routing.Call("all_reduce", dtype=tensor.dtype, op=op))
        return path.via.all_reduce(tensor, op)

    def _cuda_all_reduce(self, tensor: _Tensor, op: Any) -> _Tensor:
        """CUDA tensors: tpcomm.cuda.CustomAllreduce first (SUM, its sizes and
        dtypes), else NCCL (the group's, or a private one over the set-up store)."""
        op = as_reduce_op("all_reduce", op)
        if self._route("all_reduce", routing.Call("all_reduce", cuda=True)) == "local":
            return tensor
        if op is ReduceOp.SUM:
            car = self._cuda_ar.get(tensor.device)
            if car is None:
                from .cuda import CustomAllreduce

                car = self._cuda_ar[tensor.device] = CustomAllreduce(self, tensor.device)
            res = car.custom_all_reduce(tensor)
            if res is not None:
                return tensor.copy_(res)
        if self._cuda_dist is None:
            if self._group is not None:
                self._cuda_dist = DistPath(self._group, self._rank, self._world)
            else:
                store, prefix, rank, world = self._store, self._prefix, self._rank, self._world
                timeout = self._timeout
                self._cuda_dist = DistPath(
                    lambda: private_nccl(store, f"{prefix}/nccl", rank, world, timeout),
                    rank,
                    world,
                    label="nccl, tpcomm's own",
                )
        return self._cuda_dist.all_reduce(tensor, op)

    # -- data-moving collectives -----------------------------------------------

    def all_gather(self, tensor: _Tensor, dim: int = 0) -> _Tensor:
        """All ranks' ``tensor`` concatenated along ``dim`` (same shape on every rank).

        Returns:
            A new tensor, bitwise identical on every rank.
        """
        if _compiling():
            return compiled.all_gather(self, tensor, dim)
        eng = self._engine
        # the common case (a plain tensor, an int dim): one C check, the same rounds
        # and layout key as the general path below, ~8 us less per call
        if eng is not None and type(dim) is int:
            # 1-d: one C call, as all_gather_into_tensor (same key: protocols.flat_key)
            if dim == 0 and type(tensor) is _Tensor and tensor.dim() == 1:
                out = torch.empty(self._world * tensor.shape[0], dtype=tensor.dtype)
                status = eng.fast_all_gather(out, tensor, KIND_ALL_GATHER)
                if status == 0:
                    return out
                if status is not None:
                    eng.raise_status(status, "all_gather")
            res = self._plain_gather(eng, "all_gather", KIND_ALL_GATHER, tensor, dim, None, None)
            if res is not _NOT_PLAIN:
                return res
        fn = "all_gather"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        d = checks.dim(fn, tensor, dim)
        return self._gather(fn, KIND_ALL_GATHER, tensor, [tensor.shape[d]] * self._world, d, None)

    def all_gatherv(self, tensor: _Tensor, sizes: Sequence[int], dim: int = 0) -> _Tensor:
        """Like all_gather, but rank r contributes ``sizes[r]`` entries along ``dim``
        (any of them may be 0); the other dims must agree."""
        fn = "all_gatherv"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        d = checks.dim(fn, tensor, dim)
        with self._own_checks():
            sizes = checks.sizes(fn, sizes, self._world)
            if tensor.shape[d] != sizes[self._rank]:
                raise ValueError(
                    f"{fn}: rank {self._rank} has size {tensor.shape[d]} along dim {d} "
                    f"but sizes[{self._rank}] = {sizes[self._rank]}"
                )
        return self._gather(fn, KIND_ALL_GATHER, tensor, sizes, d, None)

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
        eng = self._engine
        # the common case (a plain tensor, a fitting out= or none): see all_gather;
        # 1-d: one C call (fast_gather, the same layout key)
        if eng is not None and type(dim) is int and type(dst) is int and 0 <= dst < self._world:
            if (
                type(tensor) is _Tensor
                and tensor.dim() == 1
                and (dim == 0 or dim == -1)
                and (out is None or (type(out) is _Tensor and out.dim() == 1))
            ):
                res = out if self._rank == dst else None
                if res is None and self._rank == dst:
                    res = torch.empty(self._world * tensor.shape[0], dtype=tensor.dtype)
                status = eng.fast_gather(tensor, res, dst, KIND_GATHER)
                if status == 0:
                    return res
                if status is not None:
                    eng.raise_status(status, "gather")
            res = self._plain_gather(eng, "gather", KIND_GATHER, tensor, dim, dst, out)
            if res is not _NOT_PLAIN:
                return res
        fn = "gather"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        dst = checks.rank(fn, "dst", dst, self._world)
        d = checks.dim(fn, tensor, dim)
        sizes = [tensor.shape[d]] * self._world
        bad = None
        if out is not None and self._rank == dst:
            shape = list(tensor.shape)
            shape[d] *= self._world
            try:
                checks.tensor(fn, out, "out")
                checks.writable(fn, out, "out")
                if out.dtype != tensor.dtype or list(out.shape) != shape:
                    raise ValueError(
                        f"{fn}: out has dtype {out.dtype} and shape {tuple(out.shape)}, "
                        f"expected {tensor.dtype} and {tuple(shape)}"
                    )
            except (TypeError, ValueError) as e:
                bad = e
            else:
                if is_dense(out):
                    return self._gather(fn, KIND_GATHER, tensor, sizes, d, dst, out=out)
        res = self._gather(fn, KIND_GATHER, tensor, sizes, d, dst)
        if self._rank != dst:
            return None
        if bad is not None:
            raise type(bad)(f"{bad} (the gather itself completed; out is untouched)")
        return res if out is None else out.copy_(res)

    def all_gather_into_tensor(self, output: _Tensor, input: _Tensor) -> _Tensor:
        """torch-style: ``output`` (world_size x input's elements, same dtype) gets every
        rank's ``input`` in rank order, flattened along dim 0.  Returns ``output``."""
        if _compiling():
            return compiled.all_gather_into_tensor(self, output, input)
        eng = self._engine
        # the common case (plain tensors, output = world x input): one C call
        # (_native/torch.c fast_all_gather) with the general path's metadata; None: the
        # general path below does every check and handles views and subclasses
        if eng is not None:
            status = eng.fast_all_gather(output, input, KIND_ALL_GATHER)
            if status is not None:
                if status:
                    eng.raise_status(status, "all_gather_into_tensor")
                return output
        fn = "all_gather_into_tensor"
        self._check_open(fn)
        checks.tensor(fn, output, "output")
        checks.writable(fn, output, "output")
        checks.tensor(fn, input, "input")
        with self._own_checks():
            checks.same_dtype(fn, output, input)
            checks.world_times(fn, output, "output", input, "input", self._world)
        res = self._gather(
            fn,
            KIND_ALL_GATHER,
            input.reshape(-1),
            [input.numel()] * self._world,
            0,
            None,
            out=output if is_dense(output) else None,
        )
        if res is not output:
            output.copy_(res.view(output.shape))
        return output

    def all_gather_into_list(self, outputs: Sequence[_Tensor], tensor: _Tensor) -> list:
        """torch's list form: ``outputs[r]`` gets rank r's ``tensor`` (every output
        has ``tensor``'s dtype and element count; shapes may differ).  Returns
        ``outputs``."""
        return self._gather_list("all_gather_into_list", KIND_ALL_GATHER, outputs, tensor, None)

    def gather_into_list(
        self, outputs: Optional[Sequence[_Tensor]], tensor: _Tensor, dst: int = 0
    ) -> Optional[list]:
        """torch's list form of gather: on ``dst``, ``outputs[r]`` gets rank r's
        ``tensor``; elsewhere ``outputs`` is ignored (may be None) and None comes
        back."""
        return self._gather_list("gather_into_list", KIND_GATHER, outputs, tensor, dst)

    def _gather_list(
        self, fn: str, kind: int, outputs: Any, tensor: _Tensor, root: Optional[int]
    ) -> Optional[list]:
        mine = root is None or root == self._rank
        if mine:
            with self._own_checks():  # the root's alone in gather_into_list
                outputs = checks.tensor_list(fn, outputs, written=True)
                if len(outputs) != self._world:
                    raise ValueError(
                        f"{fn}: expected {self._world} output tensors, got {len(outputs)}"
                    )
        outs = outputs if mine else [None] * self._world
        if self._gather_into_list(fn, kind, outs, tensor, root):
            return list(outputs) if mine else None
        flat = tensor.reshape(-1)
        if root is None:
            got = torch.empty(self._world * flat.numel(), dtype=flat.dtype)
            self.all_gather_into_tensor(got, flat)
        else:
            got = self.gather(flat, dst=root)
        if not mine:
            return None
        n = flat.numel()
        for o, part in zip(outputs, got.split(n) if n else [got[:0]] * self._world):
            if o.numel() != n:
                raise ValueError(
                    f"{fn}: output tensors must have {n} elements each, got {o.numel()}"
                )
            o.copy_(part.view(o.shape))
        return list(outputs)

    def _plain_gather(
        self,
        eng: Any,
        fn: str,
        kind: int,
        tensor: _Tensor,
        dim: int,
        root: Optional[int],
        out: Optional[_Tensor],
    ) -> Any:
        """all_gather / gather (root) of a plain tensor (``ShmEngine.plain``) along an
        int dim in range, into a fitting ``out`` or a new tensor: one C check and
        the rounds, with _gather's rows and layout key.  _NOT_PLAIN when the call
        is not that case (the general path then checks and reports)."""
        a = eng.plain(tensor)
        if a is None:
            return _NOT_PLAIN
        nd = tensor.dim()
        if not -nd <= dim < nd:
            return _NOT_PLAIN
        d = dim % nd
        shape = tensor.shape
        w = self._world
        full = (*shape[:d], w * shape[d], *shape[d + 1 :])
        res = None
        if root is None or root == self._rank:
            if out is None:
                res = torch.empty(full, dtype=tensor.dtype)
            else:
                b = eng.plain(out)
                if b is None or b[0] != a[0] or out.shape != full:
                    return _NOT_PLAIN
                res = out
        rest = tuple(shape[:d]) + tuple(shape[d + 1 :])
        key = protocols.layout_key(kind, rest, d, (shape[d],) * w, root)
        protocols.gatherv(
            eng, fn, kind, a[1], [a[2] * layout.ANY_SIZE[a[0]]] * w,
            res.data_ptr() if res is not None else None, a[0], a[2] * w, key,
            layout.prod(shape[:d]) or 1,
        )  # fmt: skip
        return res

    def _gather_into_list(
        self, fn: str, kind: int, outs: Sequence[_Tensor], tensor: _Tensor, root: Optional[int]
    ) -> bool:
        """Every rank's ``tensor`` (flattened) straight into ``outs[r]``, on every
        rank (``root`` None) or on ``root``: the list forms of torch's all_gather and
        gather without a gathered temporary and a copy per part.  Only for plain
        tensors of one dtype and element count (``ShmEngine.plain``); False (nothing
        done) otherwise.  Same rounds and layout key as a 1-d all_gather / gather,
        so ranks that take this path and ranks that do not still agree."""
        eng = self._engine
        if eng is None or len(outs) != self._world:
            return False
        a = eng.plain(tensor)
        if a is None:
            return False
        addrs = None
        if root is None or root == self._rank:
            addrs = []
            for o in outs:
                b = eng.plain(o)
                if b is None or b[0] != a[0] or b[2] != a[2]:
                    return False
                addrs.append(b[1] or 0)
        w = self._world
        key = protocols.layout_key(kind, (), 0, (a[2],) * w, root)
        protocols.gatherv(
            eng, fn, kind, a[1] or 0, [a[2] * layout.ANY_SIZE[a[0]]] * w, addrs, a[0], a[2] * w, key
        )
        return True

    def _gather(
        self,
        fn: str,
        kind: int,
        tensor: _Tensor,
        sizes: list[int],
        d: int,
        root: Optional[int],
        out: Optional[_Tensor] = None,
    ) -> _Tensor:
        call = routing.Call(
            "gather" if root is not None else "all_gather",
            rooted=root is not None,
            even=len(set(sizes)) == 1,
        )
        path = self._route(fn, call)
        if path != "shm":
            return self._gather_moved(tensor, sizes, d, root, out, path)
        # the engine gathers along d where the data is: rank r's tensor is
        # `rows` blocks (one per index of the dims before d), and row a of the
        # result is every rank's block a in rank order (gatherv's rows)
        x = dense(tensor)
        shape = tuple(x.shape)
        rows = layout.prod(shape[:d])
        rest = shape[:d] + shape[d + 1 :]
        full = (*shape[:d], sum(sizes), *shape[d + 1 :])
        res = None
        if root is None or root == self._rank:
            res = out if out is not None else torch.empty(full, dtype=tensor.dtype)
        inner = layout.prod(shape[d + 1 :]) * rows * tensor.element_size()
        key = protocols.layout_key(kind, rest, d, tuple(sizes), root)
        protocols.gatherv(
            self._engine,
            fn,
            kind,
            x.data_ptr(),
            [s * inner for s in sizes],
            res.data_ptr() if res is not None else None,
            protocols.dtype_code_any(tensor.dtype),
            sum(sizes) * layout.prod(rest),
            key,
            max(rows, 1),
        )
        return res

    def _gather_moved(
        self,
        tensor: _Tensor,
        sizes: list[int],
        d: int,
        root: Optional[int],
        out: Optional[_Tensor],
        path: str,
    ) -> Optional[_Tensor]:
        """_gather across hosts (hier), through torch.distributed (dist), or at
        world size 1 (local): along dim 0 of the tensor with dim d moved first."""
        moved = dense(tensor.movedim(d, 0) if d else tensor)
        if path == "hier":
            got = self._hier.all_gather(moved)
        elif path == "dist":
            if root is None:
                got = self._dist.all_gatherv(moved, sizes)
            else:
                got = self._dist.gather(moved, root)
            if got is None:
                return None
        else:  # world size 1: a copy, like every other rank count (from a
            # copy when the result overlaps the input, as torch's copy_ refuses)
            overlaps = out is not None and layout.any_overlap([moved], [out])
            got = moved if out is not None and not overlaps else moved.clone()
        if out is not None:
            if d:
                out.copy_(got.movedim(0, d))
            else:
                out.view(got.shape).copy_(got)
            return out
        return got.movedim(0, d).contiguous() if d else got

    def reduce_scatter(self, tensor: _Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM) -> _Tensor:
        """This rank's shard of the reduction: the reduction of every rank's
        ``tensor``, split in world_size equal parts along ``dim``, part ``rank``."""
        if _compiling():
            return compiled.reduce_scatter(self, tensor, dim, op)
        fn = "reduce_scatter"
        self._check_open(fn)
        op = checks.reduce_op(fn, tensor, op)
        d = checks.dim(fn, tensor, dim)
        size = tensor.shape[d]
        if size % self._world:
            raise ValueError(
                f"{fn}: dim {d} has size {size}, which world size {self._world} "
                f"does not divide; use reduce_scatterv with explicit sizes"
            )
        sizes = [size // self._world] * self._world
        return self._reduce_scatter(fn, tensor, sizes, d, op)

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
            sizes = checks.sizes(fn, sizes, self._world)
            if sum(sizes) != tensor.shape[d]:
                raise ValueError(
                    f"{fn}: sizes add up to {sum(sizes)} but dim {d} has size {tensor.shape[d]}"
                )
        return self._reduce_scatter(fn, tensor, sizes, d, op)

    def reduce_scatter_tensor(
        self, output: _Tensor, input: _Tensor, op: ReduceOp = ReduceOp.SUM
    ) -> _Tensor:
        """torch-style: ``output`` gets this rank's part of the reduction of every rank's
        ``input`` (world_size x output's elements, flattened).  Returns ``output``."""
        if _compiling():
            return compiled.reduce_scatter_tensor(self, output, input, op)
        eng = self._engine
        if eng is not None:  # one C call, as all_gather_into_tensor (None: the general path)
            status = eng.fast_reduce_scatter(output, input, op, KIND_REDUCE_SCATTER)
            if status is not None:
                if status:
                    eng.raise_status(status, "reduce_scatter_tensor")
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
        res = self._reduce_scatter(fn, input.reshape(-1), sizes, 0, op)
        output.copy_(res.view(output.shape))
        return output

    def _reduce_scatter(
        self, fn: str, tensor: _Tensor, sizes: list[int], d: int, op: Any
    ) -> _Tensor:
        path = self._route(fn, routing.Call("reduce_scatter", dtype=tensor.dtype, op=op))
        if path != "shm":
            moved = dense(tensor.movedim(d, 0) if d else tensor)
            if path == "dist":
                res = self._dist.reduce_scatterv(moved, sizes, op)
            elif path == "hier":
                res = self._hier.reduce_scatterv(moved, sizes, op, self._rank)
            else:  # local: the reduction over one rank
                res = moved.clone()
            return res.movedim(0, d).contiguous() if d else res
        # along d where the data is: `rows` rows (one per index of the dims
        # before d), each the ranks' blocks side by side (reduce_scatterv's rows)
        x = dense(tensor)
        shape = tuple(x.shape)
        rows = layout.prod(shape[:d])
        inner = layout.prod(shape[d + 1 :]) if rows else 0  # no rows: nothing to move
        res = torch.empty((*shape[:d], sizes[self._rank], *shape[d + 1 :]), dtype=tensor.dtype)
        key = protocols.layout_key(shape[:d] + shape[d + 1 :], d, tuple(sizes))
        protocols.reduce_scatterv(
            self._engine,
            fn,
            x.data_ptr(),
            DTYPE_CODES[tensor.dtype],
            [s * inner for s in sizes],
            res.data_ptr(),
            op.value,
            key,
            max(rows, 1),
        )
        return res

    def broadcast(self, tensor: _Tensor, src: int = 0) -> _Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place; returns it."""
        if _compiling():
            return compiled.broadcast(self, tensor, src)
        eng = self._engine
        if eng is not None:  # a plain tensor: one C call (None: the general path below)
            status = eng.fast_broadcast(tensor, src, KIND_BROADCAST)
            if status is not None:
                if status:
                    eng.raise_status(status, "broadcast")
                return tensor
        fn = "broadcast"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        checks.writable(fn, tensor)
        src = checks.rank(fn, "src", src, self._world)
        path = self._route(fn, routing.Call("broadcast"))
        if path == "hier":
            return self._hier.broadcast(tensor, src)
        if path == "dist":
            return self._dist.broadcast(tensor, src)
        if path == "local":
            return tensor
        work = dense(tensor)
        protocols.broadcast(
            self._engine,
            fn,
            work.data_ptr(),
            work.numel() * work.element_size(),
            src,
            protocols.dtype_code_any(tensor.dtype),
            tensor.numel(),
        )
        if work is not tensor:
            tensor.copy_(work)
        return tensor

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
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (tuple, list, torch.Size)) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape
        ):
            raise ValueError(f"{fn}: shape must be non-negative ints, got {shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype, got {type(dtype).__name__}")
        shape = tuple(int(s) for s in shape)
        if self._route(fn, routing.Call("empty")) != "shm":  # ordinary memory
            return torch.empty(shape, dtype=dtype)
        key = protocols.layout_key("empty", shape, str(dtype))
        return symmetric.allocate(
            self._engine, fn, shape, dtype, protocols.dtype_code_any(dtype), key
        )

    def peer_buffers(self, tensor: _Tensor) -> list[_Tensor]:
        """For a tensor made by ``empty()``: every rank's copy of its shared buffer,
        as uint8 tensors mapped in this process (rank order), which this process
        may read and write (symmetric memory: a kernel can address any rank's
        copy).  Not collective.  World size 1 or across hosts: ``[buffer]``, this
        rank's own memory only."""
        fn = "peer_buffers"
        self._check_open(fn)
        checks.tensor(fn, tensor)
        if self._engine is None:
            return [tensor.reshape(-1).view(torch.uint8)]
        return symmetric.peer_views(self._engine, tensor)

    # -- point to point --------------------------------------------------------

    def send(self, tensors: Sequence[_Tensor], dst: int) -> None:
        """Send a list of tensors (any count, shapes and dtypes) to rank ``dst``.

        Not collective: only ``dst`` calls ``recv(src=this rank)``.  Messages from one
        rank to another arrive in order; ``send`` returns as soon as the data is in
        shared memory; it waits only while the channel to ``dst`` is full (a ring of 64
        chunks holding 2 x slot bytes / world size, at least 128 KiB; a message takes
        at least one chunk) with messages ``dst`` has not received yet.
        """
        eng = self._engine
        if eng is not None:  # plain tensors: one C call (None: the general path below)
            status = eng.p2p_send_tensors(dst, tensors)
            if status is not None:
                if status:
                    eng.raise_status(status, "send")
                return
        fn = "send"
        self._check_open(fn)
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        self._send(fn, dst, tensors, None)

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
        eng = self._engine
        if eng is not None and out is not None:  # see send
            got = protocols.recv_into(eng, fn, src, out)
            if got is not None:
                return got[0]
        elif eng is not None:  # into new tensors, one C call
            new = eng.p2p_recv_new(src)
            if type(new) is list:
                return new
            if type(new) is int:
                eng.raise_status(new, fn)
            if new is not None:  # a header C leaves to Python (pickled)
                return protocols.recv_rest(eng, fn, src, None, new)[0]
        self._check_open(fn)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        if out is not None:
            out = checks.tensor_list(fn, out, written=True)
            for i, o in enumerate(out):
                if not is_dense(o):
                    raise ValueError(
                        f"{fn}: out tensors must be dense (contiguous, not a conj/neg view); "
                        f"tensors[{i}] is not dense: shape {tuple(o.shape)}, strides "
                        f"{o.stride()}; nothing was received"
                    )
        return self._recv(fn, src, out)[0]

    def recv_any(self, out: Optional[Sequence[_Tensor]] = None) -> tuple[int, list[_Tensor]]:
        """Receive the next message from whichever rank's arrives first.

        Returns ``(src, tensors)``.  Messages from one rank still arrive in the
        order it sent them; among ranks with one waiting, the search starts after
        the last rank received this way, so none starves.  ``out`` as in
        ``recv``.  Shared memory only (one host): across hosts, ``CommError``.
        """
        fn = "recv_any"
        self._check_open(fn)
        if self._world == 1:
            raise ValueError(f"{fn}: there is no other rank to receive from (world size 1)")
        eng = self._engine
        if eng is None:
            raise CommError(
                f"{fn}: receiving from any rank needs shared memory (the ranks span "
                f"hosts); name the source rank"
            )
        status, src = eng.p2p_wait_any()
        if status:
            eng.raise_status(status, fn)
        return src, self.recv(src, out)

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
        fn = "all_to_all_single"
        eng = self._engine
        # the common case (plain tensors of one dtype, split sizes None or lists of
        # ints): one C call (_native/torch.c fast_all_to_all) with the rounds and
        # split table of the general path below; None: that path, which checks all
        if eng is not None:
            status = eng.fast_all_to_all(
                output, input, output_split_sizes, input_split_sizes, KIND_ALL_TO_ALL
            )
            if status is not None:
                if status:
                    eng.raise_status(status, fn)
                return output
        self._check_open(fn)
        checks.tensor(fn, output, "output")
        checks.writable(fn, output, "output")
        checks.tensor(fn, input, "input")
        outs = checks.splits(fn, "output_split_sizes", output_split_sizes)
        ins = checks.splits(fn, "input_split_sizes", input_split_sizes)
        shm = self._route(fn, routing.Call("all_to_all")) == "shm"
        if shm and not ins and not outs:
            with self._own_checks():
                self._even_all_to_all_check(fn, output, input)
        if not shm:  # through all_gathers, whose split table checks every rank's
            self._all_to_all_gathered(fn, output, input, outs, ins)
            return output
        eng = self._engine
        eng.hold(fn)  # the split table and the rounds are one thread's turn
        try:
            self._all_to_all_shm(fn, output, input, outs, ins)
        finally:
            eng.release()
        return output

    def _even_all_to_all_check(self, fn: str, output: _Tensor, input: _Tensor) -> None:
        """Without split sizes: even blocks, checked here and by the rounds'
        metadata (the block size), before anything is copied."""
        w = self._world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        if rows_in % w or rows_out != rows_in or input.dtype != output.dtype or row != out_row:
            raise ValueError(
                f"{fn}: input {tuple(input.shape)} {input.dtype} and output "
                f"{tuple(output.shape)} {output.dtype}: without split sizes both need the "
                f"same shape and dtype, with rows divisible by the {w} ranks"
            )

    def _all_to_all_table(
        self, fn: str, output: _Tensor, input: _Tensor, outs: list, ins: list
    ) -> list:
        """Every rank's split sizes, checked by every rank: one all_gather of
        everyone's, so every rank reaches the same verdict (and raises together)
        and all run the same rounds.  Returns the row counts sends[q][j] from
        rank q to rank j (what rank j receives, once checked)."""
        w = self._world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        ins = ins or [rows_in // w] * w
        outs = outs or [rows_out // w] * w
        # else "not W sizes >= 0 (and below 2**63)", as the core says
        ok = len(ins) == len(outs) == w and 0 <= min(ins + outs) <= max(ins + outs) < 2**63
        code_in = protocols.dtype_code_any(input.dtype)
        code_out = protocols.dtype_code_any(output.dtype)
        mine = (ins + outs if ok else [-1] * 2 * w) + [
            rows_in, rows_out, row, out_row, code_in, code_out,
        ]  # fmt: skip
        every = torch.empty(w * (2 * w + 6), dtype=torch.int64)
        self.all_gather_into_tensor(every, torch.tensor(mine, dtype=torch.int64))
        problem = split_table_problem(w, every.tolist())
        if problem is not None:
            raise ValueError(f"{fn}: {problem}")
        return every.view(w, 2 * w + 6)[:, :w].tolist()

    def _all_to_all_shm(
        self, fn: str, output: _Tensor, input: _Tensor, outs: list, ins: list
    ) -> None:
        w = self._world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        even = not ins and not outs  # checked (_even_all_to_all_check), and by the rounds
        x = dense(input)
        res = output if is_dense(output) else torch.empty(output.shape, dtype=output.dtype)
        if layout.dense_overlap(x, res):
            x = x.clone()
        if even:
            sb = [rows_in // w * row] * w
            protocols.alltoallv(
                self._engine, x.data_ptr(), sb, layout.offsets(sb), res.data_ptr(), sb,
                layout.offsets(sb), sb[0], protocols.dtype_code_any(input.dtype),
            )  # fmt: skip
        else:
            # any split sizes, even uniform ones (they depend on data, as in MoE
            # dispatch, so ranks may differ): every rank's table, checked by every
            # rank, then the rounds, in one call (_native/rounds.c alltoall_splits)
            status = self._engine.alltoall_splits(
                KIND_ALL_TO_ALL, x.data_ptr(), ins or [rows_in // w] * w, res.data_ptr(),
                outs or [rows_out // w] * w, rows_in, rows_out, row, out_row,
                protocols.dtype_code_any(input.dtype), protocols.dtype_code_any(output.dtype),
            )  # fmt: skip
            if status:
                self._engine.raise_status(status, fn)
        if res is not output:
            output.copy_(res)

    def _all_to_all_gathered(
        self, fn: str, output: _Tensor, input: _Tensor, outs: list, ins: list
    ) -> None:
        """all_to_all_single without shared memory (one rank, or across hosts):
        the checked split table, then every rank's whole input gathered and this
        rank's blocks picked out (memory: the world's inputs, a fallback)."""
        w, me = self._world, self._rank
        sends = self._all_to_all_table(fn, output, input, outs, ins)
        per_row = layout.prod(input.shape[1:])  # elements
        flat = dense(input).reshape(-1)
        sizes = [sum(sends[q]) * per_row for q in range(w)]
        everyone = self.all_gatherv(flat, sizes) if w > 1 else flat
        starts = layout.offsets(sizes)
        parts = []
        for q in range(w):
            at = starts[q] + sum(sends[q][:me]) * per_row
            parts.append(everyone[at : at + sends[q][me] * per_row])
        output.copy_(torch.cat(parts).view(output.shape))

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
                without them the message lands in new tensors (one copy more).

        Returns:
            The received tensors (``out``'s when given).
        """
        fn = "sendrecv"
        eng = self._engine
        if eng is not None:  # plain tensors: one C call (see send)
            got = eng.p2p_sendrecv(dst, tensors, src, out)
            if type(got) is int:
                if got:
                    eng.raise_status(got, fn)
                return list(out)  # type: ignore[arg-type]
            if got is not None:  # no out, or it did not match: received aside
                return self._sendrecv_rest(fn, src, out, *got)
        self._check_open(fn)
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        if out is not None:
            out = checks.tensor_list(fn, out, written=True)
        if self._route(fn, routing.Call("p2p")) == "dist":  # torch.distributed, sends posted first
            got, extra = self._dist.sendrecv(tensors, dst, src)
            if extra is not None:
                raise CommError(f"{fn}: rank {src} sent a dict, not a tensor list")
            if out is None:
                return got
            for o, t in zip(out, got):
                o.copy_(t)
            return list(out)
        datas = [dense(t) for t in tensors]  # alive until the call is done: pieces point in
        if out is not None and layout.any_overlap(datas, out):
            # receiving into what is being sent (a shift in place): the send and
            # the receive progress together, so the data is sent from a copy
            datas = [t.clone() for t in datas]
        header = b""  # matches no message: it lands in a bytearray
        dests: list = []
        if out is not None and all(is_dense(o) for o in out):
            header = protocols.expected_header(out) or b""
            dests = [(o.data_ptr(), n) for o in out if (n := o.numel() * o.element_size())]
        ops = [(1, dst, protocols.message_pieces(datas, None)), (0, src, header, dests)]
        odd = protocols.batch(self._engine, fn, ops)
        del datas
        if not odd:
            return list(out)  # type: ignore[arg-type]
        return self._sendrecv_rest(fn, src, out, odd[0][1], odd[0][2])

    def _sendrecv_rest(
        self, fn: str, src: int, out: Optional[Sequence[_Tensor]], got_header: bytes, data: Any
    ) -> list[_Tensor]:
        """The end of a sendrecv whose message did not match ``out`` (or had
        none): it was received whole into ``data``."""
        specs, extra = protocols.decode_header(got_header)
        if extra is not None:
            raise CommError(f"{fn}: rank {src} sent a dict or a scatter part, not a tensor list")
        got = protocols.tensors_from_bytes(specs, data)
        if out is None:
            return got
        have = [(o.dtype, tuple(o.shape)) for o in out]
        if have != [(t.dtype, tuple(t.shape)) for t in got]:
            raise ValueError(
                f"{fn}: rank {src} sent {protocols.show(specs)} but out= holds "
                f"{protocols.show(have)} (the message was received and dropped)"
            )
        for o, t in zip(out, got):  # out is not dense: copy in
            o.copy_(t)
        return list(out)

    def send_tensor_dict(self, data: dict, dst: int) -> None:
        """Send a dict whose values are tensors or any picklable Python values."""
        fn = "send_tensor_dict"
        self._check_open(fn)
        if not isinstance(data, dict):
            raise TypeError(f"{fn}: data must be a dict, got {type(data).__name__}")
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        tensors, layout = [], []
        for key, value in data.items():
            if isinstance(value, _Tensor):
                checks.tensor(fn, value, f"data[{key!r}]")
                layout.append((key, len(tensors), None))
                tensors.append(value)
            else:
                layout.append((key, None, value))
        try:
            self._send(fn, dst, tensors, layout)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"{fn}: a non-tensor value cannot be pickled: {e}") from None

    def recv_tensor_dict(self, src: int) -> dict:
        """Receive the next dict sent with send_tensor_dict by rank ``src``."""
        fn = "recv_tensor_dict"
        self._check_open(fn)
        src = checks.rank(fn, "src", src, self._world, not_rank=self._rank)
        tensors, layout = self._recv(fn, src)
        if not isinstance(layout, list):
            raise CommError(f"{fn}: rank {src} sent a tensor list, not a dict (use recv)")
        return {key: tensors[i] if i is not None else value for key, i, value in layout}

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
            parts = checks.tensor_list(fn, parts)
            if len(parts) != self._world:
                raise ValueError(f"{fn}: expected {self._world} input tensors, got {len(parts)}")
            for r in range(self._world):
                if r != src:
                    self._send(fn, r, [dense(parts[r].reshape(-1))], _SCATTER)
            return tensor.copy_(parts[src].view(tensor.shape))
        got, tag = self._recv(fn, src)
        if tag != _SCATTER:
            raise CommError(
                f"{fn}: rank {src} sent this rank a point-to-point message that was "
                f"not received yet; receive it before the scatter"
            )
        return tensor.copy_(got[0].view(tensor.shape))

    def try_send(self, tensors: Sequence[_Tensor], dst: int) -> bool:
        """Send ``tensors`` to ``dst`` only if that takes no waiting (the channel
        holds the whole message now): True when sent, False when nothing was
        (then ``send`` or ``batch_isend_irecv`` it).  Plain CPU tensors through
        shared memory only; anything else is never sent here."""
        fn = "try_send"
        self._check_open(fn)
        eng = self._engine
        if eng is None:
            return False
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self._world, not_rank=self._rank)
        datas = [dense(t) for t in tensors]
        status = eng.send_if_room(dst, protocols.message_pieces(datas, None))
        if status:
            eng.raise_status(status, "send")
        return status is not None

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
        checked = []
        for i, op in enumerate(ops):
            if not (isinstance(op, tuple) and len(op) == 3 and op[0] in ("send", "recv")):
                raise TypeError(f"{fn}: ops[{i}] must be ('send' | 'recv', tensors, peer)")
            what, tensors, peer = op
            tensors = checks.tensor_list(fn, tensors, written=what == "recv")
            name = "dst" if what == "send" else "src"
            checked.append(
                (what, tensors, checks.rank(fn, name, peer, self._world, not_rank=self._rank))
            )
        if self._route(fn, routing.Call("p2p")) == "dist":  # sends posted first, then receives
            errors: list = []
            for what, tensors, peer in checked:
                if what == "send":
                    self._send(fn, peer, tensors, None)
            for what, tensors, peer in checked:
                errors.append(
                    None if what == "send" else self._take(fn, tensors, peer, *self._recv(fn, peer))
                )
            return errors
        keep, native = [], []
        for what, tensors, peer in checked:
            if what == "send":
                datas = [dense(t) for t in tensors]
                keep.append(datas)
                native.append((1, peer, protocols.message_pieces(datas, None)))
            elif (
                all(is_dense(t) for t in tensors)
                and (header := protocols.expected_header(tensors)) is not None
            ):
                dests = [(t.data_ptr(), n) for t in tensors if (n := t.numel() * t.element_size())]
                native.append((0, peer, header, dests))
            else:  # matches no message: it lands aside, and is copied in below
                native.append((0, peer, b"", []))
        odd = protocols.batch(self._engine, fn, native)
        del keep
        errors = [None] * len(checked)
        for i, header, data in odd:  # a message that is not exactly what the recv expected
            specs, extra = protocols.decode_header(header)
            got = protocols.tensors_from_bytes(specs, data)
            errors[i] = self._take(fn, checked[i][1], checked[i][2], got, extra)
        return errors

    @staticmethod
    def _take(fn: str, tensors: list, src: int, got: list, extra: Any) -> Optional[BaseException]:
        """Put a received message into a receive's tensors (count, and per tensor
        dtype and element count must agree; shapes may differ, as with gloo); the
        error when it does not fit."""
        if extra is not None:
            return CommError(
                f"recv: rank {src} is in a scatter, not a send (the ranks called "
                f"collectives in different orders)"
            )
        if len(got) != len(tensors):
            return ValueError(f"recv: rank {src} sent {len(got)} tensors, expected {len(tensors)}")
        for t, g in zip(tensors, got):
            if t.numel() != g.numel() or t.dtype != g.dtype:
                return ValueError(
                    f"recv: rank {src} sent {g.dtype} x {g.numel()}, "
                    f"the receive buffer is {t.dtype} x {t.numel()}"
                )
        for t, g in zip(tensors, got):
            if g is not t:
                t.copy_(g.view(t.shape))
        return None

    def _send(self, fn: str, dst: int, tensors: list, extra: Any) -> None:
        if self._route(fn, routing.Call("p2p")) == "dist":
            self._dist.send(tensors, dst, extra)
        else:
            protocols.send(self._engine, fn, dst, tensors, extra)

    def _recv(self, fn: str, src: int, out: Optional[list] = None) -> tuple[list, Any]:
        if self._route(fn, routing.Call("p2p")) == "dist":
            got = self._dist.recv(src)
            if out is not None:
                for o, t in zip(out, got[0]):
                    o.copy_(t)
                return list(out), got[1]
            return got
        return protocols.recv(self._engine, fn, src, out)

    def barrier(self) -> None:
        """Return once every rank has called barrier()."""
        self._check_open("barrier")
        path = self._route("barrier", routing.Call("barrier"))
        if path == "hier":
            self._hier.barrier()
            return
        if path == "dist":
            self._dist.barrier()
            return
        if path == "local":
            return
        status = self._engine.sync(KIND_BARRIER, 0, 0, 0, 0)
        if status:
            self._raise(status, "barrier")

    def _raise(self, status: int, fn: str) -> None:
        if self._engine is None:
            self._check_open(fn)
        self._engine.raise_status(status, fn)

"""Communicator: argument checks, the choice of path per call, error mapping.

Every public collective starts with a fast check that recognises the common
case (a contiguous CPU tensor of a supported dtype) and goes straight to the
native engine; anything else goes through the full checks in ``_checked``,
which raise before anything is touched.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import weakref
from typing import Any, Optional, Union

import torch

from . import _env
from .bootstrap import exchange, host_identity
from .errors import CommError
from .ops import CODE_DTYPES, DTYPE_CODES, FLOAT_DTYPES, ReduceOp, as_reduce_op
from .shm.engine import KIND_ALL_REDUCE, KIND_BARRIER, ShmEngine

__all__ = ["Communicator"]

_Tensor = torch.Tensor
_SUPPORTED = ", ".join(str(d) for d in DTYPE_CODES)

# Communicators created on the same ranks get the same sequence number on
# every rank because every rank creates them in the same order (a collective
# contract, as in torch.distributed.new_group).
_created: collections.Counter = collections.Counter()

Timeout = Union[None, float, int, datetime.timedelta]


def _timeout_seconds(fn: str, timeout: Timeout) -> float:
    if timeout is None:
        return _env.timeout()
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{fn}: timeout must be seconds or a timedelta, got {type(timeout).__name__}"
        )
    if not timeout > 0:
        raise ValueError(f"{fn}: timeout must be positive, got {timeout}")
    return float(timeout)


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
        seconds = _timeout_seconds(fn, timeout)
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
        self._setup(store, rank, world, prefix, f"g{tag}", seconds)
        self._group = group

    @classmethod
    def from_env(cls, *, timeout: Timeout = None) -> Communicator:
        """Create a communicator from torchrun-style environment variables.

        Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  Rank 0 hosts a
        TCPStore on MASTER_ADDR:MASTER_PORT for the set-up (under torchrun,
        whose agent already serves one there, every rank connects to it).
        """
        from torch.distributed import TCPStore

        fn = "Communicator.from_env"
        seconds = _timeout_seconds(fn, timeout)
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
        if world > 1:
            store = TCPStore(
                env["MASTER_ADDR"],
                port,
                world,
                is_master=(rank == 0 and not agent),
                timeout=datetime.timedelta(seconds=seconds),
                wait_for_workers=False,
            )
        _created["env"] += 1
        self = cls.__new__(cls)
        self._setup(store, rank, world, f"tpcomm/env/{_created['env']}", "env", seconds)
        self._group = None
        return self

    @classmethod
    def _from_store(
        cls, store: Any, rank: int, world: int, prefix: str, tag: str, timeout: Timeout = None
    ) -> Communicator:
        """Create a communicator over an existing torch Store (the launcher's)."""
        self = cls.__new__(cls)
        self._setup(store, rank, world, prefix, tag, _timeout_seconds("Communicator", timeout))
        self._group = None
        return self

    def _setup(
        self, store: Any, rank: int, world: int, prefix: str, tag: str, timeout: float
    ) -> None:
        self._rank = rank
        self._world = world
        self._timeout = timeout
        self._engine: Optional[ShmEngine] = None
        self._closed = False
        if world == 1:
            return
        hosts = exchange(store, prefix, rank, world, "host", host_identity(), timeout)
        if len(set(hosts)) != 1:
            groups = collections.defaultdict(list)
            for r, h in enumerate(hosts):
                groups[h].append(r)
            raise CommError(
                f"Communicator: the group spans {len(groups)} hosts "
                f"({'; '.join(f'{h}: ranks {rs}' for h, rs in groups.items())}); the "
                f"shared-memory engine needs every rank on one host"
            )
        self._engine = ShmEngine(store, rank, world, prefix, tag, timeout)
        native = self._engine._native
        native.set_fast_path(
            torch.Tensor,
            tuple(ReduceOp),
            tuple(CODE_DTYPES[i] for i in range(len(CODE_DTYPES))),
            KIND_ALL_REDUCE,
            weakref.WeakMethod(self._all_reduce_fallback),
        )
        # The instance attribute shadows the method below: one C call per
        # all_reduce in the common case (see _native.c fast_all_reduce).
        self.all_reduce = native.fast_all_reduce

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

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failed() else "open")
        return f"<tpcomm.Communicator rank={self._rank} world_size={self._world} {state}>"

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment.  Idempotent; local (not collective).

        Peers still waiting on this rank afterwards get PeerFailedError.
        """
        if self._closed:
            return
        self._closed = True
        self.__dict__.pop("all_reduce", None)
        if self._engine is not None:
            self._engine.close()
            self._engine = None

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

    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise CommError(f"{fn}: the Communicator is closed")

    def _check_tensor(self, fn: str, tensor: Any) -> None:
        if not isinstance(tensor, _Tensor):
            raise TypeError(f"{fn}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"{fn}: expected a CPU tensor, got one on {tensor.device}; CUDA tensors go "
                f"through tpcomm.cuda.CustomAllreduce or torch.distributed (NCCL)"
            )
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise ValueError(f"{fn}: expected a dense (strided) tensor, got layout {tensor.layout}")
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"{fn}: unsupported dtype {tensor.dtype}; supported: {_SUPPORTED}")

    def _check_op(self, fn: str, tensor: _Tensor, op: Any) -> ReduceOp:
        op = as_reduce_op(fn, op)
        if op is ReduceOp.AVG and tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{fn}: ReduceOp.AVG needs a floating dtype ({', '.join(map(str, FLOAT_DTYPES))}),"
                f" got {tensor.dtype}; use ReduceOp.SUM and divide"
            )
        return op

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
        return self._all_reduce_checked(tensor, op)

    def _all_reduce_fallback(self, tensor: Any, op: Any, status: int) -> _Tensor:
        """Called by the native fast path for everything it does not handle."""
        if status:
            codes = (DTYPE_CODES[tensor.dtype], as_reduce_op("all_reduce", op).value)
            self._raise(status, "all_reduce", KIND_ALL_REDUCE, codes, tensor.numel())
        return self._all_reduce_checked(tensor, op)

    def _all_reduce_checked(self, tensor: Any, op: Any) -> _Tensor:
        fn = "all_reduce"
        self._check_open(fn)
        self._check_tensor(fn, tensor)
        op = self._check_op(fn, tensor, op)
        if self._engine is None:  # world size 1
            return tensor
        codes = (DTYPE_CODES[tensor.dtype], op.value)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        status = self._engine.all_reduce(
            work.data_ptr(), work.numel(), codes[0], codes[1], KIND_ALL_REDUCE
        )
        if status:
            self._raise(status, fn, KIND_ALL_REDUCE, codes, work.numel())
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def barrier(self) -> None:
        """Return once every rank has called barrier()."""
        self._check_open("barrier")
        if self._engine is None:
            return
        status = self._engine.barrier(KIND_BARRIER)
        if status:
            self._raise(status, "barrier", KIND_BARRIER, (0, 0), 0)

    def _raise(self, status: int, fn: str, kind: int, codes: tuple, count: int) -> None:
        if self._engine is None:
            self._check_open(fn)
        self._engine.raise_status(status, fn, kind, codes[0], codes[1], count)

"""Which path serves a call: one function (``route``), in one order.

A Communicator holds its paths in the order they are tried; a call goes to the
first whose ``should_use(call)`` has no objection, and the objection of the one
it passed over says why (logged once when the call leaves shared memory).  The
paths are the real ones (``paths.LocalPath``, ``cuda.path.CudaPath``,
``shm.path.ShmPath``, ``hierarchical.Hierarchy``, ``dist_path.DistPath``),
each with the methods of ``paths.Path``; ``plan`` gives stand-ins with the
same predicates for a group that does not exist (``tpcomm doctor``).
The order (``order``, written once):

1. ``local``: world size 1, every result is this rank's own (a copy at most);
2. ``cuda``: a CUDA tensor: the custom all-reduce over CUDA IPC, then NCCL;
3. ``shm``: the shared-memory engine (every rank on this host), for the
   dtypes and ops it does;
4. ``hier``: a group spanning hosts: shared memory inside each host, gloo
   between the host leaders, for the calls it serves;
5. ``dist``: torch.distributed (the group's backend, or a private gloo group):
   everything else.

``tpcomm doctor`` prints what ``route`` decides for a group of its size.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from .ops import DTYPE_CODES, ReduceOp
from .paths import LOCAL

__all__ = [
    "Call",
    "Route",
    "backend_way",
    "cuda_objection",
    "engine_objection",
    "hier_objection",
    "order",
    "plan",
    "route",
]

# the calls that reduce (the engine's dtypes and ops matter)
REDUCING = frozenset({"all_reduce", "reduce_scatter"})
_ENGINE_DTYPES = ", ".join(str(d) for d in DTYPE_CODES)
_ENGINE_OPS = ", ".join("ReduceOp." + o.name for o in ReduceOp)


class Call(NamedTuple):
    """What routing needs to know of a call (a tuple: cheap to make and to
    hash, which every call that is not on a fast path does).

    Attributes:
        kind: the collective (``all_reduce``, ``all_gather``, ``gather``,
            ``reduce_scatter``, ``broadcast``, ``barrier``, ``all_to_all``,
            ``p2p``, ``empty``).
        cuda: the tensor is on a CUDA device.
        dtype: the tensor's dtype (reducing calls).
        op: the reduce op (a ReduceOp, or another torch.distributed op).
        rooted: a gather with a root.
        even: every rank contributes the same size (gathers).
        sparse: the tensor is sparse (all_reduce: torch.distributed sums it).
    """

    kind: str
    cuda: bool = False
    dtype: Optional[torch.dtype] = None
    op: Any = None
    rooted: bool = False
    even: bool = True
    sparse: bool = False


class Route(NamedTuple):
    """The path a call takes (its name, and the path object), and why it is not
    shared memory when it is not."""

    path: str
    reason: str = ""
    via: Any = None


def engine_objection(call: Call) -> Optional[str]:
    """Why the shared-memory engine does not do this call, or None."""
    if call.sparse:
        return "a sparse tensor (torch.distributed sums it)"
    if call.kind not in REDUCING:
        return None
    if call.dtype is not None and call.dtype not in DTYPE_CODES:
        return f"unsupported dtype {call.dtype} (the engine reduces {_ENGINE_DTYPES})"
    if call.op is not None and not isinstance(call.op, ReduceOp):
        name = str(call.op).rsplit(".", 1)[-1]
        return f"op {name} is not supported by the engine (it does {_ENGINE_OPS})"
    return None


def cuda_objection(call: Call) -> Optional[str]:
    """Why the CUDA path does not take this call, or None: all_reduce of CUDA
    tensors only (the other collectives take CPU tensors)."""
    if not call.cuda:
        return "not a CUDA tensor"
    return None if call.kind == "all_reduce" else f"{call.kind} takes CPU tensors only"


class _Cuda:
    name = "cuda"

    @staticmethod
    def should_use(call: Call) -> Optional[str]:
        return cuda_objection(call)


class _Shm:
    name = "shm"

    @staticmethod
    def should_use(call: Call) -> Optional[str]:
        return engine_objection(call)


# what a hierarchy serves (empty as ordinary memory): the rest of a multi-host
# group's calls go to dist
_HIER_KINDS = frozenset(
    {"all_reduce", "reduce_scatter", "broadcast", "barrier", "all_gather", "empty"}
)


def hier_objection(call: Call, why: str) -> Optional[str]:
    """Why a hierarchy (``why``: how it spans hosts) does not serve this call, or None."""
    engine = engine_objection(call)
    if engine is not None:
        return engine
    if call.kind not in _HIER_KINDS:
        return why
    if call.kind == "all_gather" and (call.rooted or not call.even):
        return why
    return None


class _Hier:
    name = "hier"

    def __init__(self, why: str):
        self.why = why  # "the group spans N hosts (...)"

    def should_use(self, call: Call) -> Optional[str]:
        return hier_objection(call, self.why)


class _Dist:
    name = "dist"

    @staticmethod
    def should_use(call: Call) -> Optional[str]:
        return None


def backend_way(
    call: Call, *, tag: int = 0, shared_memory: bool = True, same_shapes: bool = True
) -> str:
    """Which of its three ways the tpcomm process group (dist_backend.py) gives
    a torch.distributed call (``call.kind``: the group's method, or ``p2p``):

    * ``"nccl"``, its private NCCL group: CUDA tensors of the calls the CUDA
      path does not take (``cuda_objection``: all but all_reduce);
    * ``"gloo"``, its private gloo group: what a Communicator cannot say or
      keep waiting (a tagged send or recv; send and recv without shared
      memory, across hosts, where gloo's Works are asynchronous; an
      all_to_all of tensors of different shapes; monitored_barrier, which
      names the ranks that did not arrive);
    * ``"comm"``: its Communicator, which routes the call on (``route``).
    """
    if call.cuda:
        return "comm" if cuda_objection(call) is None else "nccl"
    if call.kind == "monitored_barrier":
        return "gloo"
    if call.kind == "p2p" and (tag or not shared_memory):
        return "gloo"
    if call.kind == "all_to_all" and not same_shapes:
        return "gloo"
    return "comm"


def order(world: int, cuda: Any, middle: Any, dist: Any) -> list:
    """The paths of a group of ``world`` ranks, in the order ``route`` tries
    them (``middle``: shared memory, or the hierarchy of a group across hosts).
    The one place the order is written."""
    if world == 1:
        return [LOCAL]
    return [cuda, middle, dist]


def plan(world: int, hosts: int = 1, why_hosts: str = "") -> list:
    """Stand-ins for the paths of a group of ``world`` ranks on ``hosts`` hosts
    that does not exist (``tpcomm doctor``), in ``order``, with the real paths'
    objections (``why_hosts``: how a multi-host group is described)."""
    middle = _Shm() if hosts == 1 else _Hier(why_hosts or f"the group spans {hosts} hosts")
    return order(world, _Cuda(), middle, _Dist())


def route(paths: Sequence[Any], call: Call) -> Route:
    """The first of ``paths`` that takes ``call``; the reason is the objection
    of the shared-memory or hierarchical path it passed over (if any)."""
    reason = ""
    for p in paths:
        why = p.should_use(call)
        if why is None:
            return Route(p.name, reason, p)
        if p.name != "cuda":
            reason = why
    raise AssertionError("routing: no path takes the call; the last path must take all")

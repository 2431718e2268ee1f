"""The torch.distributed backend ``tpcomm``: plain ``dist.*`` calls through shared memory.

Importing tpcomm registers it::

    dist.init_process_group("cpu:tpcomm,cuda:nccl")   # or backend="tpcomm"
    dist.all_reduce(x)                                 # CPU tensor: shared memory

torch 2.13 lets Python implement a whole ``ProcessGroup`` (a Python subclass of
``c10d.Backend`` cannot be constructed), and a backend creator that returns a
``ProcessGroup`` replaces the group torch was assembling.  So this group
serves every device itself: CPU tensors go to a ``Communicator`` (shared
memory; hierarchical when the group spans hosts), what the engine does not do
goes to a private gloo group made over the same store, and CUDA tensors go to
a private NCCL group made on their first collective.  docs/BACKEND.md lists
which call takes which path.

Every call but send and recv completes before it returns: ``async_op=True``
gives a Work that is already done, whose future holds the outputs.  Sends and
receives (isend, irecv, batch_isend_irecv) wait in the group until one of
their Works is waited on or the next call, and then run together
(dist_work.py; docs/BACKEND.md), so no order of them deadlocks.  The group
uses only the Communicator's public API.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from . import _env, routing
from .communicator import Communicator
from .dist_path import DistPath, private_gloo, private_nccl
from .dist_work import _WAITING as _WAITING
from .dist_work import DONE, Deferred, Done, Received, flush_waiting
from .errors import CommError
from .ops import ReduceOp, is_dense

__all__ = ["ProcessGroupTpcomm", "BACKEND_NAME", "register"]

BACKEND_NAME = "tpcomm"
log = logging.getLogger("tpcomm")

_RED = dist.ReduceOp.RedOpType
_SUM = _RED.SUM
_OPS = {
    _RED.SUM: ReduceOp.SUM,
    _RED.AVG: ReduceOp.AVG,
    _RED.MAX: ReduceOp.MAX,
    _RED.MIN: ReduceOp.MIN,
}


def _op(red: Any) -> Any:
    """A torch.distributed ReduceOp as tpcomm's (other ops pass through to gloo)."""
    kind = red.op
    return _OPS.get(kind, kind)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


class ProcessGroupTpcomm(dist.ProcessGroup):
    """A torch.distributed ProcessGroup over tpcomm's shared-memory engine."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        group_name: str = "",
    ):
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if timeout else None
        self._store = store
        self._name = group_name
        self._seconds = seconds or 1800.0  # the private groups' timeout
        self._gloo = private_gloo(store, "tpcomm-gloo", rank, size, self._seconds)
        self._fallback = DistPath(self._gloo, rank, size, label="gloo, in the tpcomm backend")
        # CUDA all-reduces: the Communicator tries tpcomm.cuda first, then this NCCL
        self._nccl: Any = None
        self._cuda_path = DistPath(self._cuda, rank, size, label="nccl, in the tpcomm backend")
        # the engine's waits: TPCOMM_TIMEOUT when set, else the group's timeout
        waits = None if _env.timeout_is_set() else seconds
        self._comm = Communicator.from_store(
            store, rank, size, prefix="tpcomm-pg", timeout=waits, fallback=self._fallback,
            cuda_fallback=self._cuda_path,
        )  # fmt: skip
        self._world = size
        self._rank = rank
        self._deferred = Deferred(self._comm)  # sends and recvs not run yet

    # -- identity -------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def communicator(self) -> Communicator:
        """The tpcomm Communicator that carries this group's CPU collectives."""
        return self._comm

    def __repr__(self) -> str:
        return f"<tpcomm.ProcessGroupTpcomm rank={self._rank} size={self._world}>"

    # -- where a call goes ----------------------------------------------------

    def _cuda(self) -> Any:
        """The private NCCL group for CUDA tensors, made on their first collective."""
        if self._nccl is None:
            self._nccl = private_nccl(
                self._store, "tpcomm-nccl", self._rank, self._world, self._seconds
            )
        return self._nccl

    def _gpu(self, kind: str, tensors: Any) -> Any:
        """The prologue of every call but allreduce, send and recv: run the
        deferred sends and receives of every group, then say where the call goes
        (routing.backend_way): the private NCCL group, or None (this group's
        own code)."""
        if _WAITING:
            flush_waiting()
        cuda = False
        for t in tensors:
            cuda = any(x.is_cuda for x in t) if isinstance(t, (list, tuple)) else t.is_cuda
            break
        way = routing.backend_way(routing.Call(kind, cuda=cuda))
        return self._cuda() if way == "nccl" else None

    # -- reductions -----------------------------------------------------------

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        # the hot path of plain dist.all_reduce: every attribute read here costs
        # a fraction of a microsecond (docs/PERFORMANCE.md, backend overhead)
        if _WAITING:
            flush_waiting()
        if len(tensors) == 1 and opts is not None:
            red = opts.reduceOp
            if red == _SUM:
                self._comm.all_reduce(tensors[0])  # no op argument: the C call's quickest form
            else:
                self._comm.all_reduce(tensors[0], _op(red))
            return Done(tensors) if opts.asyncOp else DONE
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for t in tensors:  # CUDA tensors too: the custom all-reduce, else NCCL
            self._comm.all_reduce(t, op)
        return Done(tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        if (g := self._gpu("allreduce_coalesced", tensors)) is not None:
            return g.allreduce_coalesced(tensors, opts)
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([_flat(t) for t in group])
            self._comm.all_reduce(flat, op)
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view(t.shape))
        return Done(tensors)

    def reduce(self, tensors: list, opts: Any) -> Any:
        if (g := self._gpu("reduce", tensors)) is not None:
            return g.reduce(tensors, opts)
        op = _op(opts.reduceOp)
        for t in tensors:
            # only the root's tensor is defined afterwards; the others keep theirs
            self._comm.all_reduce(t if self._rank == opts.rootRank else t.clone(), op)
        return Done(tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        if (g := self._gpu("reduce_scatter_single", [input])) is not None:
            return g._reduce_scatter_base(output, input, opts)
        self._comm.reduce_scatter_tensor(output, input, _op(opts.reduceOp))
        return Done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any) -> Any:
        if (g := self._gpu("reduce_scatter", outputs)) is not None:
            return g.reduce_scatter(outputs, input_lists, opts)
        op = _op(opts.reduceOp)
        for out, inputs in zip(outputs, input_lists):
            if len(inputs) != self._world:
                raise ValueError(
                    f"reduce_scatter: expected {self._world} input tensors, got {len(inputs)}"
                )
            flat = torch.cat([_flat(t) for t in inputs])
            res = out if is_dense(out) else torch.empty(out.shape, dtype=out.dtype)
            self._comm.reduce_scatter_tensor(res, flat, op)
            if res is not out:
                out.copy_(res)
        return Done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> Any:
        if (g := self._gpu("reduce_scatter_tensor_coalesced", outputs)) is not None:
            return g.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        op = _op(opts.reduceOp)
        for out, inp in zip(outputs, inputs):
            self._comm.reduce_scatter_tensor(out, inp, op)
        return Done(outputs)

    # torch 2.13 calls these names (distributed_c10d); without them the calls
    # reach this group through the dispatcher, slower and with a Work of its own
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gathers --------------------------------------------------------------

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if (g := self._gpu("all_gather_single", [input])) is not None:
            return g._allgather_base(output, input, opts)
        self._comm.all_gather_into_tensor(output, input)
        # gloo's Work holds the output cut into the ranks' parts
        return Done(list(output.chunk(self._world)) if output.numel() else [output])

    _allgather_base = all_gather_single

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if (g := self._gpu("allgather", inputs)) is not None:
            return g.allgather(output_lists, inputs, opts)
        for outs, inp in zip(output_lists, inputs):
            if len(outs) != self._world:
                raise ValueError(
                    f"all_gather: expected {self._world} output tensors, got {len(outs)}"
                )
            for i, o in enumerate(outs):  # as gloo and torch's documentation say
                if o.shape != inp.shape:
                    raise ValueError(
                        f"all_gather: output tensor {i} has shape {tuple(o.shape)}, the input "
                        f"{tuple(inp.shape)}; every output must have the input's shape"
                    )
            self._comm.all_gather_into_list(outs, inp)
        # gloo's Work holds the output list (one input: its list alone)
        return Done(output_lists[0] if len(output_lists) == 1 else output_lists)

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if (g := self._gpu("allgather_coalesced", inputs)) is not None:
            return g.allgather_coalesced(output_lists, inputs, opts)
        for i, inp in enumerate(inputs):
            self._comm.all_gather_into_list([outs[i] for outs in output_lists], inp)
        return Done(output_lists)

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        if (g := self._gpu("allgather_into_tensor_coalesced", inputs)) is not None:
            return g.allgather_into_tensor_coalesced(outputs, inputs, opts)
        for out, inp in zip(outputs, inputs):
            self._comm.all_gather_into_tensor(out, inp)
        return Done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_lists: list, inputs: list, opts: Any) -> Any:
        if (g := self._gpu("gather", inputs)) is not None:
            return g.gather(output_lists, inputs, opts)
        root = opts.rootRank
        for i, inp in enumerate(inputs):
            self._comm.gather_into_list(output_lists[i] if self._rank == root else None, inp, root)
        # gloo's Work: the root's output list, the others' nothing
        if self._rank != root:
            return Done([])
        return Done(output_lists[0] if len(output_lists) == 1 else output_lists)

    # -- one to all -----------------------------------------------------------

    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        if (g := self._gpu("broadcast", tensors)) is not None:
            return g.broadcast(tensors, opts)
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            self._comm.broadcast(t, root)
        return Done(tensors)

    def scatter(self, outputs: list, input_lists: list, opts: Any) -> Any:
        if (g := self._gpu("scatter", outputs)) is not None:
            return g.scatter(outputs, input_lists, opts)
        root = opts.rootRank
        for i, out in enumerate(outputs):
            self._comm.scatter(out, input_lists[i] if self._rank == root else None, root)
        return Done(outputs)

    # -- all to all -----------------------------------------------------------

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list,
        in_splits: list,
        opts: Any,
    ) -> Any:
        if (g := self._gpu("alltoall_base", [input])) is not None:
            return g.alltoall_base(output, input, out_splits, in_splits, opts)
        self._comm.all_to_all_single(output, input, out_splits, in_splits)
        return Done([output])

    all_to_all_single = alltoall_base  # the name torch 2.13 calls

    def alltoall(self, outputs: list, inputs: list, opts: Any) -> Any:
        if (g := self._gpu("alltoall", inputs)) is not None:
            return g.alltoall(outputs, inputs, opts)
        shapes = {(t.shape, t.dtype) for t in (*inputs, *outputs)}
        if routing.backend_way(routing.Call("all_to_all"), same_shapes=len(shapes) == 1) == "gloo":
            self._fallback.note("all_to_all", "tensors of different shapes")
            return self._private_gloo().alltoall(outputs, inputs, opts)
        flat = torch.cat([_flat(t) for t in inputs])
        res = torch.empty_like(flat)
        self.alltoall_base(res, flat, [], [], opts)
        for o, part in zip(outputs, res.split(flat.numel() // len(outputs))):
            o.copy_(part.view(o.shape))
        return Done(outputs)

    # -- synchronisation and point to point -----------------------------------

    def barrier(self, opts: Any = None) -> Any:
        if _WAITING:
            flush_waiting()
        self._comm.barrier()
        return Done([])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        """gloo's (it names the ranks that did not arrive), as torch calls it:
        ``monitored_barrier(timeout, wait_all_ranks=...)``."""
        if _WAITING:
            flush_waiting()
        gloo = self._private_gloo()
        if timeout is None:
            return gloo.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    def send(self, tensors: list, dst: int, tag: int = 0) -> Any:
        if self._p2p_way(tensors, tag) != "comm":
            return self._p2p_now(True, tensors, dst, tag)
        if not self._deferred.sends_to(dst) and self._comm.try_send(tensors, dst):
            return Done(tensors)  # the channel's ring took it all at once
        return self._deferred.add("send", tensors, dst)  # see dist_work.Deferred

    def recv(self, tensors: list, src: int, tag: int = 0) -> Any:
        if self._p2p_way(tensors, tag) != "comm":
            return self._p2p_now(False, tensors, src, tag)
        return self._deferred.add("recv", tensors, src)

    def _p2p_way(self, tensors: list, tag: int) -> str:
        """Where a send or recv goes (routing.backend_way): "comm" waits in the
        group (Deferred); the others do not."""
        call = routing.Call("p2p", cuda=any(t.is_cuda for t in tensors))
        return routing.backend_way(call, tag=tag, shared_memory=self._comm.shared_memory)

    def _p2p_now(self, send: bool, tensors: list, peer: int, tag: int) -> Any:
        """A send or recv that does not wait in the group, after whatever does:
        to NCCL or gloo, whose Works are asynchronous (so batches cannot
        deadlock there either)."""
        g = self._gpu("p2p", tensors) or self._private_gloo()
        return g.send(tensors, peer, tag) if send else g.recv(tensors, peer, tag)

    def recv_anysource(self, tensors: list, tag: int = 0) -> Any:
        """``dist.recv(t)`` / ``irecv(t)`` without a source: the first message to
        arrive from any rank, after every send and recv deferred before it; the
        Work says who sent it.  With a tag, or across hosts: gloo's."""
        if self._p2p_way(tensors, tag) != "comm":
            return self._private_gloo().recv_anysource(tensors, tag)
        if _WAITING:
            flush_waiting()
        src, _ = self._comm.recv_any(tensors)
        return Received(tensors, src)

    def _private_gloo(self) -> Any:
        if self._gloo is None:
            raise CommError("the tpcomm process group is shut down (destroy_process_group)")
        return self._gloo

    def shutdown(self) -> None:
        """destroy_process_group(): close the engine and free the private groups now."""
        if self._deferred:  # sends and recvs nobody waited for: run them, as gloo would
            try:
                self._deferred.flush()
            except Exception as e:
                log.warning("tpcomm: send/recv not waited for before shutdown failed: %s", e)
        self._comm.close()
        # Left to the garbage collector (the Communicator and this group form a
        # cycle through the CUDA fallback path), the private gloo group could be freed during
        # interpreter shutdown, where its destructor may abort the process
        # ("terminate called without an active exception", seen once under torchrun).
        for path in (self._fallback, self._cuda_path):
            path.release()
        self._gloo = None
        self._nccl = None

    def abort(self) -> None:
        self.shutdown()


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupTpcomm:
    return ProcessGroupTpcomm(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id
    )


def register() -> None:
    """Register the ``tpcomm`` backend with torch.distributed (done on import)."""
    if dist.is_available() and BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )

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
their Works is waited on or the group's next call, and then run together
(_Pending, _flush; docs/BACKEND.md), so no order of them deadlocks.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from .communicator import Communicator
from .dist_fallback import DistPath, private_gloo, private_nccl
from .errors import CommError
from .ops import ReduceOp, dense, is_dense
from .shm import protocols
from .shm.engine import KIND_ALL_GATHER, KIND_GATHER

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

# all_to_all through shared memory gathers every rank's whole input; above
# this many bytes per rank it goes to gloo instead
ALLTOALL_SHM_MAX = 1 << 20

# marks the messages of scatter, so that one of them is never taken for a
# user's send (and the other way round)
_SCATTER = "tpcomm.scatter"


def _op(red: Any) -> Any:
    """A torch.distributed ReduceOp as tpcomm's (other ops pass through to gloo)."""
    kind = red.op
    return _OPS.get(kind, kind)


class _Done(dist._Work):
    """The Work of a call that has finished: its future holds ``result``."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


# returned by the calls that are not async_op: nothing reads its result
_DONE = _Done([])


class _Pending(dist._Work):
    """The Work of a send or recv (isend / irecv): the operation waits in its
    group until a Work of the group is waited on, or the group's next other
    call, and then runs together with every other one waiting (_flush), so no
    order of them can deadlock (what batch_isend_irecv promises)."""

    def __init__(self, pg: ProcessGroupTpcomm, result: Any):
        super().__init__()
        self._pg = pg
        self._result = result
        self._done = False
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:  # every group's, in the order they began to wait
            _flush_all()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            _flush_all()
        return True

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


# the groups with sends or recvs waiting (_Pending): any call of any tpcomm group
# runs them first, so a rank that isends on one group and then calls a
# collective of another does not hold its message back from a receiver that
# must get it before joining that collective
_WAITING: list = []


def _flush_all() -> None:
    for pg in list(_WAITING):
        pg._flush()


class _P2P:
    """A send or recv waiting in its group: its p2p_batch op, and the tensors
    (a send's dense data, a recv's destinations) that keep its memory alive."""

    __slots__ = ("work", "op", "keep")

    def __init__(self, work: _Pending, op: tuple, keep: list):
        self.work, self.op, self.keep = work, op, keep


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _copy_parts(outs: list, flat: torch.Tensor, fn: str) -> None:
    n = flat.numel() // max(1, len(outs))
    for o, part in zip(outs, flat.split(n) if n else [flat[:0]] * len(outs)):
        if o.numel() != n:
            raise ValueError(f"{fn}: output tensors must have {n} elements each, got {o.numel()}")
        o.copy_(part.view(o.shape))


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
        # the engine's waits: TPCOMM_TIMEOUT when set, else the group's timeout
        waits = None if os.environ.get("TPCOMM_TIMEOUT") else seconds
        self._comm = Communicator._from_store(
            store, rank, size, "tpcomm-pg", "pg", waits, fallback=self._fallback
        )
        self._nccl: Any = None
        self._world = size
        self._rank = rank
        self._pending: list[_P2P] = []  # sends and recvs not run yet (_flush)
        # CUDA all-reduces: the Communicator tries tpcomm.cuda first, then this NCCL
        self._comm._cuda_dist = DistPath(
            self._cuda, rank, size, label="nccl, in the tpcomm backend"
        )

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

    @staticmethod
    def _on_gpu(tensors: Any) -> bool:
        for t in tensors:
            if isinstance(t, (list, tuple)):
                return any(x.is_cuda for x in t)
            return t.is_cuda
        return False

    # -- reductions -----------------------------------------------------------

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        # the hot path of plain dist.all_reduce: every attribute read here costs
        # a fraction of a microsecond (docs/PERFORMANCE.md, backend overhead)
        if _WAITING:
            _flush_all()
        if len(tensors) == 1 and opts is not None:
            red = opts.reduceOp
            if red == _SUM:
                self._comm.all_reduce(tensors[0])  # no op argument: the C call's quickest form
            else:
                self._comm.all_reduce(tensors[0], _op(red))
            return _Done(tensors) if opts.asyncOp else _DONE
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for t in tensors:  # CUDA tensors too: the custom all-reduce, else NCCL
            self._comm.all_reduce(t, op)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(tensors):
            return self._cuda().allreduce_coalesced(tensors, opts)
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([_flat(t) for t in group])
            self._comm.all_reduce(flat, op)
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view(t.shape))
        return _Done(tensors)

    def reduce(self, tensors: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(tensors):
            return self._cuda().reduce(tensors, opts)
        op = _op(opts.reduceOp)
        for t in tensors:
            # only the root's tensor is defined afterwards; the others keep theirs
            self._comm.all_reduce(t if self._rank == opts.rootRank else t.clone(), op)
        return _Done(tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if input.is_cuda:
            return self._cuda()._reduce_scatter_base(output, input, opts)
        self._comm.reduce_scatter_tensor(output, input, _op(opts.reduceOp))
        return _Done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(outputs):
            return self._cuda().reduce_scatter(outputs, input_lists, opts)
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
        return _Done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(outputs):
            return self._cuda().reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        op = _op(opts.reduceOp)
        for out, inp in zip(outputs, inputs):
            self._comm.reduce_scatter_tensor(out, inp, op)
        return _Done(outputs)

    # -- gathers --------------------------------------------------------------

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if input.is_cuda:
            return self._cuda()._allgather_base(output, input, opts)
        self._comm.all_gather_into_tensor(output, input)
        return _Done([output])

    _allgather_base = all_gather_single

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(inputs):
            return self._cuda().allgather(output_lists, inputs, opts)
        for outs, inp in zip(output_lists, inputs):
            if len(outs) != self._world:
                raise ValueError(
                    f"all_gather: expected {self._world} output tensors, got {len(outs)}"
                )
            if self._comm._gather_into_list("all_gather", KIND_ALL_GATHER, outs, inp, None):
                continue
            flat = torch.empty(self._world * inp.numel(), dtype=inp.dtype)
            self._comm.all_gather_into_tensor(flat, inp)
            _copy_parts(outs, flat, "all_gather")
        return _Done(output_lists)

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(inputs):
            return self._cuda().allgather_coalesced(output_lists, inputs, opts)
        for i, inp in enumerate(inputs):
            flat = torch.empty(self._world * inp.numel(), dtype=inp.dtype)
            self._comm.all_gather_into_tensor(flat, inp)
            _copy_parts([outs[i] for outs in output_lists], flat, "all_gather_coalesced")
        return _Done(output_lists)

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(inputs):
            return self._cuda().allgather_into_tensor_coalesced(outputs, inputs, opts)
        for out, inp in zip(outputs, inputs):
            self._comm.all_gather_into_tensor(out, inp)
        return _Done(outputs)

    def gather(self, output_lists: list, inputs: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(inputs):
            return self._cuda().gather(output_lists, inputs, opts)
        root = opts.rootRank
        for i, inp in enumerate(inputs):
            outs = output_lists[i] if self._rank == root else [None] * self._world
            if self._comm._gather_into_list("gather", KIND_GATHER, outs, inp, root):
                continue
            got = self._comm.gather(_flat(inp), dst=root)
            if self._rank == root:
                _copy_parts(output_lists[i], got, "gather")
        return _Done(output_lists)

    # -- one to all -----------------------------------------------------------

    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(tensors):
            return self._cuda().broadcast(tensors, opts)
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            self._comm.broadcast(t, root)
        return _Done(tensors)

    def scatter(self, outputs: list, input_lists: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(outputs):
            return self._cuda().scatter(outputs, input_lists, opts)
        comm = self._comm
        if comm._engine is None:  # across hosts (or one rank): gloo, like send/recv there
            return self._private_gloo().scatter(outputs, input_lists, opts)
        root = opts.rootRank
        for i, out in enumerate(outputs):
            if self._rank == root:
                parts = input_lists[i]
                if len(parts) != self._world:
                    raise ValueError(
                        f"scatter: expected {self._world} input tensors, got {len(parts)}"
                    )
                for r in range(self._world):
                    if r != root:
                        comm._send("scatter", r, [dense(_flat(parts[r]))], _SCATTER)
                out.copy_(parts[root].view(out.shape))
            else:
                got, tag = comm._recv("scatter", root)
                if tag != _SCATTER:
                    raise CommError(
                        f"scatter: rank {root} sent this rank a point-to-point message "
                        f"that was not received yet; receive it before the scatter"
                    )
                out.copy_(got[0].view(out.shape))
        return _Done(outputs)

    # -- all to all -----------------------------------------------------------

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list,
        in_splits: list,
        opts: Any,
    ) -> Any:
        if _WAITING:
            _flush_all()
        if input.is_cuda:
            return self._cuda().alltoall_base(output, input, out_splits, in_splits, opts)
        comm = self._comm
        if comm._engine is None or comm._hier is not None:  # world 1, or across hosts
            return self._alltoall_gather(output, input, out_splits, in_splits, opts)
        comm.all_to_all_single(output, input, out_splits, in_splits)
        return _Done([output])

    def _alltoall_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list,
        in_splits: list,
        opts: Any,
    ) -> Any:
        """all_to_all_single through one all_gather (world size 1, groups across
        hosts: the Communicator routes it), or gloo for uneven or large ones."""
        nbytes = input.numel() * input.element_size()
        if out_splits or in_splits or nbytes > ALLTOALL_SHM_MAX or input.numel() % self._world:
            self._fallback.note("all_to_all_single", "uneven or large all_to_all")
            return self._private_gloo().alltoall_base(output, input, out_splits, in_splits, opts)
        w = self._world
        everyone = torch.empty(w * input.numel(), dtype=input.dtype)
        self._comm.all_gather_into_tensor(everyone, input)
        mine = everyone.view(w, w, -1)[:, self._rank]
        output.copy_(mine.reshape(output.shape))
        return _Done([output])

    def alltoall(self, outputs: list, inputs: list, opts: Any) -> Any:
        if _WAITING:
            _flush_all()
        if self._on_gpu(inputs):
            return self._cuda().alltoall(outputs, inputs, opts)
        shapes = {(t.shape, t.dtype) for t in (*inputs, *outputs)}
        if len(shapes) != 1:
            self._fallback.note("all_to_all", "tensors of different shapes, or large")
            return self._private_gloo().alltoall(outputs, inputs, opts)
        flat = torch.cat([_flat(t) for t in inputs])
        res = torch.empty_like(flat)
        self.alltoall_base(res, flat, [], [], opts)
        _copy_parts(outputs, res, "all_to_all")
        return _Done(outputs)

    # -- synchronisation and point to point -----------------------------------

    def barrier(self, opts: Any = None) -> Any:
        if _WAITING:
            _flush_all()
        self._comm.barrier()
        return _Done([])

    def monitored_barrier(self, *args: Any) -> Any:
        if _WAITING:
            _flush_all()
        return self._private_gloo().monitored_barrier(*args)

    def send(self, tensors: list, dst: int, tag: int = 0) -> Any:
        if tag or self._on_gpu(tensors) or self._comm._engine is None:
            return self._p2p_now(True, tensors, dst, tag)
        datas = [dense(t) for t in tensors]
        pieces = protocols.message_pieces(datas, None)
        if not any(p.op[0] == 1 and p.op[1] == dst for p in self._pending):
            # at once when the channel's ring takes all of it without waiting
            eng = self._comm._engine
            status = eng._native.p2p_send(dst, pieces, True)
            if status is not None:
                if status:
                    eng.raise_status(status, "send")
                return _Done(tensors)
        # else it waits for its Work (or the next call): see _Pending
        work = _Pending(self, tensors)
        self._wait_with(_P2P(work, (1, dst, pieces), datas))
        return work

    def recv(self, tensors: list, src: int, tag: int = 0) -> Any:
        header = None
        if not (tag or self._on_gpu(tensors) or self._comm._engine is None) and all(
            is_dense(t) for t in tensors
        ):
            header = protocols.expected_header(tensors)
        if header is None:
            return self._p2p_now(False, tensors, src, tag)
        work = _Pending(self, tensors)
        dests = [(t.data_ptr(), n) for t in tensors if (n := t.numel() * t.element_size())]
        op = (0, src, header, dests)
        self._wait_with(_P2P(work, op, tensors))
        return work

    def _wait_with(self, p2p: _P2P) -> None:
        if not self._pending:
            _WAITING.append(self)
        self._pending.append(p2p)

    def _p2p_now(self, send: bool, tensors: list, peer: int, tag: int) -> Any:
        """A send or recv that does not wait in the group, after whatever does:
        CUDA tensors go to NCCL; a tag, or a group without shared memory (across
        hosts), to gloo, whose Works are asynchronous (so batches cannot
        deadlock there either); a recv into tensors without a compact header
        takes the engine's ordinary path."""
        if _WAITING:
            _flush_all()
        if self._on_gpu(tensors) or tag or self._comm._engine is None:
            g = self._cuda() if self._on_gpu(tensors) else self._private_gloo()
            return g.send(tensors, peer, tag) if send else g.recv(tensors, peer, tag)
        if send:
            self._comm.send(tensors, peer)
        else:
            self._recv_now(tensors, peer)
        return _Done(tensors)

    def _recv_now(self, tensors: list, src: int) -> None:
        direct = all(is_dense(t) for t in tensors)
        got, extra = self._comm._recv("recv", src, list(tensors) if direct else None)
        self._take(tensors, src, got, extra)

    @staticmethod
    def _take(tensors: list, src: int, got: list, extra: Any) -> None:
        """Check a received message against the recv's tensors (count, and per
        tensor dtype and element count: shapes may differ, as with gloo) and
        copy it in where it is not there yet."""
        if extra is not None:
            raise CommError(
                f"recv: rank {src} is in a scatter, not a send (the ranks called "
                f"collectives in different orders)"
            )
        if len(got) != len(tensors):
            raise ValueError(f"recv: rank {src} sent {len(got)} tensors, expected {len(tensors)}")
        for t, g in zip(tensors, got):
            if t.numel() != g.numel() or t.dtype != g.dtype:
                raise ValueError(
                    f"recv: rank {src} sent {g.dtype} x {g.numel()}, "
                    f"the receive buffer is {t.dtype} x {t.numel()}"
                )
        for t, g in zip(tensors, got):
            if g is not t:
                t.copy_(g.view(t.shape))

    def _flush(self) -> None:
        """Run the sends and recvs waiting in this group (see _Pending): a send
        alone as a plain send, anything else progressed together in one native
        call (a recv too: a message of another shape is then judged as gloo
        judges it, see _take)."""
        pending, self._pending = self._pending, []
        if self in _WAITING:
            _WAITING.remove(self)
        if not pending:
            return
        if len(pending) == 1 and pending[0].op[0] == 1:  # a send alone: the ordinary path
            p = pending[0]
            try:
                self._comm.send(p.keep, p.op[1])
            except BaseException as e:
                p.work._finish(e)
                raise
            p.work._finish(None)
            return
        try:
            odd = protocols.batch(self._comm._engine, "send/recv", [p.op for p in pending])
        except BaseException as e:
            for p in pending:
                p.work._finish(e)
            raise
        errors: dict[int, BaseException] = {}
        for i, header, data in odd:  # a message that is not exactly what the recv expected
            try:
                specs, extra = protocols.decode_header(header)
                got = protocols.tensors_from_bytes(specs, data)
                self._take(pending[i].keep, pending[i].op[1], got, extra)
            except (ValueError, CommError) as e:
                errors[i] = e
        for i, p in enumerate(pending):
            p.work._finish(errors.get(i))

    def recv_anysource(self, tensors: list, tag: int = 0) -> Any:
        raise CommError(
            "recv: the tpcomm backend needs the source rank (messages travel on "
            "per-pair channels); pass src="
        )

    def _private_gloo(self) -> Any:
        if self._gloo is None:
            raise CommError("the tpcomm process group is shut down (destroy_process_group)")
        return self._gloo

    def shutdown(self) -> None:
        """destroy_process_group(): close the engine and free the private groups now."""
        if self._pending:  # sends and recvs nobody waited for: run them, as gloo would
            try:
                self._flush()
            except Exception as e:
                log.warning("tpcomm: send/recv not waited for before shutdown failed: %s", e)
        self._comm.close()
        # Left to the garbage collector (the Communicator and this group form a
        # cycle through _cuda_dist), the private gloo group could be freed during
        # interpreter shutdown, where its destructor may abort the process
        # ("terminate called without an active exception", seen once under torchrun).
        for path in (self._fallback, self._comm._cuda_dist):
            if path is not None:
                path.release()
        self._comm._cuda_dist = None
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

"""The torch.distributed path: what the shared-memory engine does not do.

A path of the Communicator (``paths.Path``), the last one: it takes every
call.  Used per call for a dtype or op the engine does not implement (complex,
float64 sums, PRODUCT, ...), for the calls of a group that spans hosts that
the hierarchy (hierarchical.py) does not cover, and by the torch.distributed
backend (dist_backend.py) for everything it routes away from shared memory.

It calls the methods of a ``ProcessGroup`` directly (``pg.allreduce([t],
opts)``), not the ``dist.*`` functions: that works the same for a group the
user registered with torch.distributed (group-local ranks, no translation)
and for a private gloo group tpcomm creates over a store, which
torch.distributed does not know.  Each reason is logged once.

gloo lacks some collectives (reduce_scatter, AVG, uneven all_gather); they
are composed from the ones it has, with the same results.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _env, layout
from .bootstrap import threaded
from .errors import CommError
from .ops import ReduceOp, dense, is_dense
from .paths import DimFirst, copy_in

__all__ = ["DistPath", "private_gloo", "private_nccl"]

log = logging.getLogger("tpcomm")

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


def private_gloo(store: Any, prefix: str, rank: int, world: int, timeout: float) -> Any:
    """A gloo ProcessGroup of its own over ``store`` (keys under ``prefix``),
    unknown to torch.distributed; every one of the ``world`` ranks must create it."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return threaded(
        ProcessGroupGloo(PrefixStore(f"{prefix}/", store), rank, world, _env.timedelta(timeout))
    )


def _real(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors travel as their real view (as torch.distributed does)."""
    return torch.view_as_real(t) if t.is_complex() else t


def private_nccl(store: Any, prefix: str, rank: int, world: int, timeout: float) -> Any:
    """An NCCL ProcessGroup of its own over ``store`` (CUDA tensors), like private_gloo."""
    from torch.distributed import PrefixStore

    try:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL
    except ImportError:
        raise CommError("tpcomm: a CUDA collective needs NCCL, and this torch has none") from None
    opts = ProcessGroupNCCL.Options()
    opts._timeout = _env.timedelta(timeout)
    return threaded(ProcessGroupNCCL(PrefixStore(f"{prefix}/", store), rank, world, opts))


class DistPath(DimFirst):
    """Collectives over one torch ProcessGroup, in that group's ranks.

    Args:
        group: the ProcessGroup, or a function making it on first use (all
            ranks reach the first use at the same collective call).
        label: how the log names it (default: the group's backend name).
    """

    def __init__(
        self,
        group: Union[Any, Callable[[], Any]],
        rank: int,
        world: int,
        label: Optional[str] = None,
    ):
        self._group = group
        self._made = not callable(group) or isinstance(group, dist.ProcessGroup)
        self.rank = rank
        self.world = world
        self.label = label
        self._said: set[str] = set()

    @property
    def group(self) -> Any:
        if not self._made:
            self._group = self._group()
            self._made = True
        return self._group

    def release(self) -> None:
        """Drop the group.  A private group is then freed at once, while the
        interpreter is whole, instead of whenever the cycle collector gets to
        its holder, which may be during interpreter shutdown, where freeing a
        gloo group can abort the process (docs/BACKEND.md)."""
        self._group = None
        self._made = True

    def note(self, fn: str, reason: str) -> None:
        """Log once per reason that this call goes to torch.distributed."""
        if reason not in self._said:
            self._said.add(reason)
            label = self.label
            if label is None:
                try:
                    label = dist.get_backend(self.group)
                except Exception:
                    label = "torch.distributed"
            log.warning(
                "tpcomm: %s goes to torch.distributed (%s): %s; this is logged once",
                fn,
                label,
                reason,
            )

    # as a path of the Communicator (routing.py): the last one, it takes anything
    name = "dist"

    @staticmethod
    def should_use(call: Any) -> Optional[str]:
        return None

    def all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        if t.is_sparse:  # routing sends sparse tensors here (engine_objection)
            return self.all_reduce_sparse(t, op)
        work = dense(t)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is ReduceOp.AVG else _OPS.get(op, op)
        if work.is_complex() and opts.reduceOp != dist.ReduceOp.SUM:
            raise ValueError(f"all_reduce: {op} is not defined for complex tensors")
        self.group.allreduce([_real(work)], opts).wait()
        if op is ReduceOp.AVG:
            work.div_(self.world)
        if work is not t:
            t.copy_(work)
        return t

    def all_reduce_sparse(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """A sparse tensor summed in place by the group (gloo's sparse all-reduce)."""
        if op is not ReduceOp.SUM:
            raise ValueError(f"all_reduce: a sparse tensor is summed only (SUM), got {op}")
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.group.allreduce([t], opts).wait()
        return t

    def gather0(
        self, moved: torch.Tensor, sizes: Sequence[int], root: Optional[int]
    ) -> Optional[torch.Tensor]:
        """``moved``: this rank's part with the gathered dim first."""
        return self.all_gatherv(moved, sizes) if root is None else self.gather(moved, root)

    def all_gatherv(self, moved: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        top = max(sizes)
        if all(s == top for s in sizes):
            pad = dense(moved)
        else:
            pad = torch.zeros((top, *moved.shape[1:]), dtype=moved.dtype)
            pad[: moved.shape[0]] = moved
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        self.group.allgather(
            [[_real(p) for p in parts]], [_real(pad)], c10d.AllgatherOptions()
        ).wait()
        if pad is moved or all(s == top for s in sizes):
            return torch.cat(parts)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    def gather(self, moved: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
        mine = self.rank == dst
        parts = [torch.empty_like(moved) for _ in range(self.world)] if mine else []
        opts = c10d.GatherOptions()
        opts.rootRank = dst
        into = [[_real(p) for p in parts]] if mine else []
        self.group.gather(into, [_real(dense(moved))], opts).wait()
        return torch.cat(parts) if mine else None

    def reduce_scatter0(self, moved: torch.Tensor, sizes: Sequence[int], op: Any) -> torch.Tensor:
        full = self.all_reduce(moved.clone(), op)
        return full.split(list(sizes))[self.rank].clone()

    def all_to_all(
        self, fn: str, output: torch.Tensor, input: torch.Tensor, outs: list, ins: list
    ) -> None:
        """The split table checked by every rank alike (``split_table``), then
        the group's own all-to-all."""
        sends = self.split_table(fn, output, input, outs, ins)
        res = output if is_dense(output) else torch.empty(output.shape, dtype=output.dtype)
        x = dense(input)
        if layout.dense_overlap(x, res):
            x = x.clone()
        me = self.rank
        self.group.alltoall_base(
            _real(res), _real(x), [s[me] for s in sends], sends[me], c10d.AllToAllOptions()
        ).wait()
        if res is not output:
            output.copy_(res)

    def broadcast(self, fn: str, t: torch.Tensor, src: int) -> torch.Tensor:
        work = dense(t)
        opts = c10d.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.group.broadcast([_real(work)], opts).wait()
        if work is not t:
            t.copy_(work)
        return t

    def barrier(self, fn: str = "barrier") -> None:
        self.group.barrier(c10d.BarrierOptions()).wait()

    def _post(self, tensors: Sequence[torch.Tensor], dst: int, extra: Any) -> list:
        """Start sending a message (length, header, tensors); the Works to wait for
        (each holds its tensor)."""
        meta = pickle.dumps(([(t.dtype, tuple(t.shape)) for t in tensors], extra))
        head = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        g = self.group
        parts = [torch.tensor([head.numel()], dtype=torch.int64), head]
        parts += [_real(dense(t)) for t in tensors if t.numel()]
        return [(g.send([part], dst, 0), part) for part in parts]

    def send(self, fn: str, dst: int, tensors: Sequence[torch.Tensor], extra: Any) -> None:
        for work, _ in self._post(tensors, dst, extra):
            work.wait()

    def sendrecv(
        self,
        fn: str,
        tensors: Sequence[torch.Tensor],
        dst: int,
        src: int,
        out: Optional[Sequence[torch.Tensor]],
    ) -> list:
        """Send to dst while receiving from src: the sends are posted first and
        waited for last, so a ring of ranks doing this cannot wait on each other."""
        posted = self._post(tensors, dst, None)
        got, extra = self._recv(src)
        for work, _ in posted:
            work.wait()
        if extra is not None:
            raise CommError(f"{fn}: rank {src} sent a dict, not a tensor list")
        return got if out is None else copy_in(out, got)

    def recv(
        self, fn: str, src: int, out: Optional[Sequence[torch.Tensor]] = None
    ) -> tuple[list, Any]:
        got, extra = self._recv(src)
        return (got if out is None else copy_in(out, got)), extra

    def _recv(self, src: int) -> tuple[list[torch.Tensor], Any]:
        g = self.group
        n = torch.empty(1, dtype=torch.int64)
        g.recv([n], src, 0).wait()
        head = torch.empty(int(n.item()), dtype=torch.uint8)
        g.recv([head], src, 0).wait()
        specs, extra = pickle.loads(head.numpy().tobytes())
        out = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                g.recv([_real(t)], src, 0).wait()
            out.append(t)
        return out, extra

"""The torch.distributed path: what the shared-memory engine does not do.

Used (1) for every call when the group spans hosts, and (2) per call for a
dtype or op the engine does not implement (complex, float64 sums, PRODUCT,
...).  Both need the torch.distributed group the Communicator was created
on; a communicator made by ``from_env`` or ``launch`` has none and raises
instead.  Each reason is logged once per communicator.

gloo lacks some collectives (reduce_scatter, AVG, uneven all_gather); they
are composed from the ones it has, with the same results.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .ops import ReduceOp

__all__ = ["DistPath"]

log = logging.getLogger("tpcomm")

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class DistPath:
    """Collectives of one Communicator over its torch.distributed group."""

    def __init__(self, group: Any, rank: int, world: int):
        self.group = group
        self.rank = rank
        self.world = world
        self._said: set[str] = set()

    def note(self, fn: str, reason: str) -> None:
        """Log once per reason that this call goes to torch.distributed."""
        if reason not in self._said:
            self._said.add(reason)
            log.warning(
                "tpcomm: %s goes to torch.distributed (%s): %s; this is logged once",
                fn,
                dist.get_backend(self.group),
                reason,
            )

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)

    def all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        work = t if t.is_contiguous() else t.contiguous()
        if op is ReduceOp.AVG:
            dist.all_reduce(work, op=dist.ReduceOp.SUM, group=self.group)
            work.div_(self.world)
        else:
            dist.all_reduce(work, op=_OPS.get(op, op), group=self.group)
        if work is not t:
            t.copy_(work)
        return t

    def all_gatherv(self, moved: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """``moved``: this rank's part with the gathered dim first."""
        top = max(sizes)
        pad = torch.zeros((top, *moved.shape[1:]), dtype=moved.dtype)
        pad[: moved.shape[0]] = moved
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    def gather(self, moved: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
        parts = [torch.empty_like(moved) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(moved, parts, dst=self._global(dst), group=self.group)
        return torch.cat(parts) if parts is not None else None

    def reduce_scatterv(self, moved: torch.Tensor, sizes: Sequence[int], op: Any) -> torch.Tensor:
        full = self.all_reduce(moved.clone(), op)
        return full.split(list(sizes))[self.rank].clone()

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        work = t if t.is_contiguous() else t.contiguous()
        dist.broadcast(work, src=self._global(src), group=self.group)
        if work is not t:
            t.copy_(work)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, extra: Any) -> None:
        meta = pickle.dumps(([(t.dtype, tuple(t.shape)) for t in tensors], extra))
        head = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        peer = self._global(dst)
        dist.send(torch.tensor([head.numel()], dtype=torch.int64), peer, group=self.group)
        dist.send(head, peer, group=self.group)
        for t in tensors:
            if t.numel():
                dist.send(t.contiguous(), peer, group=self.group)

    def recv(self, src: int) -> tuple[list[torch.Tensor], Any]:
        peer = self._global(src)
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, peer, group=self.group)
        head = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(head, peer, group=self.group)
        specs, extra = pickle.loads(head.numpy().tobytes())
        out = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                dist.recv(t, peer, group=self.group)
            out.append(t)
        return out, extra

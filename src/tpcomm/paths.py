"""The face every path of a Communicator shows, and the world-size-1 path.

A path carries a Communicator's calls one way: shared memory
(``shm/path.py``), shared memory inside each host and gloo between them
(``hierarchical.py``), torch.distributed (``dist_path.py``), CUDA
(``cuda/path.py``), or this process alone (``LocalPath`` here).  Every path
has the methods of ``Path``, with the same signatures; one that does not
serve a call says so in ``should_use(call)`` (``routing.route`` then tries
the next, in the order ``routing.order`` writes once).  The Communicator
checks the arguments before it routes: a path's method gets checked values.

Tensors come as the user gave them; ``gatherv`` and ``reduce_scatterv`` take
the dim ``d`` (in range), and ``sizes`` per rank along it.  The paths that
move data along dim 0 only (``DimFirst``: torch.distributed, hierarchical,
local) move ``d`` first and back.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import layout
from .errors import CommError
from .ops import any_code, dense

__all__ = ["DimFirst", "LocalPath", "Path", "copy_in", "take_message"]


class Path:
    """The methods every path has (the interface; the paths subclass it).

    ``name`` names the path in routing and ``tpcomm doctor``.
    """

    name = "path"

    def should_use(self, call: Any) -> Optional[str]:
        """None when this path serves ``call`` (a ``routing.Call``), else why not."""
        raise NotImplementedError

    # -- reductions --------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """``tensor`` reduced in place over every rank; returns it."""
        raise NotImplementedError

    def reduce_scatterv(
        self, fn: str, tensor: torch.Tensor, sizes: Sequence[int], d: int, op: Any
    ) -> torch.Tensor:
        """This rank's part (``sizes[rank]`` along ``d``) of the reduction."""
        raise NotImplementedError

    # -- data movement -----------------------------------------------------

    def gatherv(
        self,
        fn: str,
        tensor: torch.Tensor,
        sizes: Sequence[int],
        d: int,
        root: Optional[int],
        out: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Every rank's ``tensor`` (``sizes[r]`` along ``d``) concatenated along
        ``d``, on every rank (``root`` None) or on ``root`` (None elsewhere);
        into ``out`` (dense, the result's shape) when given."""
        raise NotImplementedError

    def gather_list(
        self, fn: str, outs: Sequence[Any], tensor: torch.Tensor, root: Optional[int]
    ) -> None:
        """Rank r's ``tensor`` (flattened) into ``outs[r]`` (checked: the same
        element count), on every rank (``root`` None) or on ``root``."""
        flat = tensor.reshape(-1)
        n = flat.numel()
        got = self.gatherv(fn, flat, [n] * len(outs), 0, root)
        if got is None:
            return
        for o, part in zip(outs, got.split(n) if n else [got[:0]] * len(outs)):
            o.copy_(part.view(o.shape))

    def broadcast(self, fn: str, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``tensor`` overwritten with ``src``'s, in place; returns it."""
        raise NotImplementedError

    def all_to_all(
        self,
        fn: str,
        output: torch.Tensor,
        input: torch.Tensor,
        outs: list,
        ins: list,
    ) -> None:
        """all_to_all_single along dim 0 (``outs`` / ``ins``: split sizes, or
        [] for even blocks): rank q's rows for this rank land in ``output``."""
        raise NotImplementedError

    def barrier(self, fn: str) -> None:
        raise NotImplementedError

    def empty(self, fn: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor the collectives on this path read in place (where they can)."""
        return torch.empty(shape, dtype=dtype)

    # -- point to point ----------------------------------------------------

    def send(self, fn: str, dst: int, tensors: Sequence[torch.Tensor], extra: Any) -> None:
        """A message (tensors and a picklable ``extra``) to ``dst``."""
        raise NotImplementedError

    def recv(
        self, fn: str, src: int, out: Optional[Sequence[torch.Tensor]] = None
    ) -> tuple[list, Any]:
        """The next message from ``src``: (tensors, extra); into ``out`` when given."""
        raise NotImplementedError

    def sendrecv(
        self,
        fn: str,
        tensors: Sequence[torch.Tensor],
        dst: int,
        src: int,
        out: Optional[Sequence[torch.Tensor]],
    ) -> list:
        """Send to ``dst`` while receiving from ``src``, so no pattern deadlocks."""
        raise NotImplementedError

    def batch(self, fn: str, ops: list) -> list:
        """Checked ``(what, tensors, peer)`` sends and receives progressed
        together; one entry per op: None, or the error of a receive whose
        message did not fit (received and dropped)."""
        errors: list = []
        for what, tensors, peer in ops:  # sends first, then receives
            if what == "send":
                self.send(fn, peer, tensors, None)
        for what, tensors, peer in ops:
            errors.append(
                None if what == "send" else take_message(tensors, peer, *self.recv(fn, peer))
            )
        return errors


def copy_in(out: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> list:
    """Received tensors copied into ``out``; returns ``out`` as a list."""
    for o, t in zip(out, got):
        o.copy_(t)
    return list(out)


def take_message(tensors: list, src: int, got: list, extra: Any) -> Optional[BaseException]:
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


class DimFirst(Path):
    """A path that gathers and scatters along dim 0 only: ``gatherv`` and
    ``reduce_scatterv`` move ``d`` first (``gather0`` / ``reduce_scatter0``) and
    back; all_to_all is every rank's input gathered (after the split table,
    which every rank checks alike)."""

    rank = 0
    world = 1

    def gather0(
        self, moved: torch.Tensor, sizes: Sequence[int], root: Optional[int]
    ) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def reduce_scatter0(self, moved: torch.Tensor, sizes: Sequence[int], op: Any) -> torch.Tensor:
        raise NotImplementedError

    def gatherv(
        self,
        fn: str,
        tensor: torch.Tensor,
        sizes: Sequence[int],
        d: int,
        root: Optional[int],
        out: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        moved = dense(tensor.movedim(d, 0) if d else tensor)
        got = self.gather0(moved, sizes, root)
        if got is None:
            return None
        if out is not None:
            if d:
                out.copy_(got.movedim(0, d))
            elif got is not out:
                out.view(got.shape).copy_(got)
            return out
        return got.movedim(0, d).contiguous() if d else got

    def reduce_scatterv(
        self, fn: str, tensor: torch.Tensor, sizes: Sequence[int], d: int, op: Any
    ) -> torch.Tensor:
        moved = dense(tensor.movedim(d, 0) if d else tensor)
        res = self.reduce_scatter0(moved, sizes, op)
        return res.movedim(0, d).contiguous() if d else res

    def split_table(
        self, fn: str, output: torch.Tensor, input: torch.Tensor, outs: list, ins: list
    ) -> list:
        """Every rank's all_to_all split sizes, checked by every rank: one gather
        of everyone's, so every rank reaches the same verdict (and raises the
        same ValueError together) and all run the same exchange.  Returns the
        row counts sends[q][j] from rank q to rank j."""
        from .shm.engine import split_table_problem

        w = self.world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        ins = ins or [rows_in // w] * w
        outs = outs or [rows_out // w] * w
        # else "not W sizes >= 0 (and below 2**63)", as the core says
        ok = len(ins) == len(outs) == w and 0 <= min(ins + outs) <= max(ins + outs) < 2**63
        mine = (ins + outs if ok else [-1] * 2 * w) + [
            rows_in, rows_out, row, out_row, any_code(input.dtype), any_code(output.dtype),
        ]  # fmt: skip
        table = torch.tensor(mine, dtype=torch.int64)
        every = self.gatherv(fn, table, [table.numel()] * w, 0, None)
        problem = split_table_problem(w, every.tolist())
        if problem is not None:
            raise ValueError(f"{fn}: {problem}")
        return every.view(w, 2 * w + 6)[:, :w].tolist()

    def all_to_all(
        self, fn: str, output: torch.Tensor, input: torch.Tensor, outs: list, ins: list
    ) -> None:
        """Through a gather of every rank's whole input (memory: the world's
        inputs), from which this rank's blocks are picked."""
        w, me = self.world, self.rank
        sends = self.split_table(fn, output, input, outs, ins)
        per_row = layout.prod(input.shape[1:])  # elements
        flat = dense(input).reshape(-1)
        sizes = [sum(sends[q]) * per_row for q in range(w)]
        everyone = self.gatherv(fn, flat, sizes, 0, None) if w > 1 else flat
        starts = layout.offsets(sizes)
        parts = []
        for q in range(w):
            at = starts[q] + sum(sends[q][:me]) * per_row
            parts.append(everyone[at : at + sends[q][me] * per_row])
        output.copy_(torch.cat(parts).view(output.shape))


class LocalPath(DimFirst):
    """World size 1: every result is this rank's own (a copy at most)."""

    name = "local"

    def should_use(self, call: Any) -> Optional[str]:
        return None

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        return tensor  # the reduction over one rank

    def gather0(
        self, moved: torch.Tensor, sizes: Sequence[int], root: Optional[int]
    ) -> torch.Tensor:
        return moved.clone()  # a copy, like every other rank count

    def reduce_scatter0(self, moved: torch.Tensor, sizes: Sequence[int], op: Any) -> torch.Tensor:
        return moved.clone()  # the reduction over one rank

    def broadcast(self, fn: str, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def barrier(self, fn: str) -> None:
        return None

    def _alone(self, fn: str) -> CommError:
        return CommError(f"{fn}: there is no other rank (world size 1)")

    def send(self, fn: str, dst: int, tensors: Sequence[torch.Tensor], extra: Any) -> None:
        raise self._alone(fn)

    def recv(self, fn: str, src: int, out: Optional[Sequence[torch.Tensor]] = None) -> tuple:
        raise self._alone(fn)

    def sendrecv(self, fn, tensors, dst, src, out) -> list:  # type: ignore[no-untyped-def]
        raise self._alone(fn)


LOCAL = LocalPath()

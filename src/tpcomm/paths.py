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

import pickle
from typing import Any, Optional, Sequence

import torch

from . import layout
from .errors import CommError
from .ops import any_code, dense
from .shm.engine import split_table_problem

__all__ = ["NOT_PLAIN", "SCATTER", "DimFirst", "LocalPath", "Path", "copy_in", "take_message"]

# marks the messages of scatter (Path.scatter; take_message refuses them)
SCATTER = "tpcomm.scatter"

# Path.fast_gather_dim: not its case (the general road runs)
NOT_PLAIN = object()


class Path:
    """The methods every path has (the interface; the paths subclass it).

    ``name`` names the path in routing and ``tpcomm doctor``; ``rank`` and
    ``world`` are this rank's and the group's.
    """

    rank = 0
    world = 1

    name = "path"

    def should_use(self, call: Any) -> Optional[str]:
        """None when this path serves ``call`` (a ``routing.Call``), else why not."""
        raise NotImplementedError

    # -- state and lifecycle (a path without shared memory: nothing to say) ---

    failed = False  # the path can no longer be used (a peer died)
    single_copy = False  # large gathers read the peers' memory directly
    ident = None  # the engine's identity (custom_ops finds a traced call's by it)

    def close(self) -> None:
        """Free what this path holds (Communicator.close); idempotent."""

    def record(self, reset: bool = False, stamp: Optional[bool] = None) -> Optional[dict]:
        """The record of rounds and waits (Communicator.stats); None: none kept."""
        return None

    def refuse(self) -> None:
        """Tell the peers this rank refused its arguments to the call they are in."""

    def dup_round(self, fn: str) -> None:
        """The round before a dup() (a mismatch shows at once, not in the store)."""

    def hold(self, fn: str) -> None:
        """Keep this rank's other threads out until release() (one operation of
        several calls); CommError when one is inside."""

    def release(self) -> None:
        pass

    def abort(self) -> None:
        """Tell the peers this rank is gone (they raise PeerFailedError)."""

    # -- the one-call entries (shm/path.py: C; here: never the call's case) ---
    # Each answers None when the call is not its case (the general road runs),
    # else it did the call (an error raised).

    def fast_all_gather(self, output: Any, input: Any, fn: str = "") -> Any:
        return None

    def fast_gather(self, tensor: Any, out: Any, dst: Any) -> Any:
        return None

    def fast_reduce_scatter(self, output: Any, input: Any, op: Any) -> Any:
        return None

    def fast_broadcast(self, tensor: Any, src: Any) -> Any:
        return None

    def fast_all_to_all(self, output: Any, input: Any, outs: Any, ins: Any) -> Any:
        return None

    def fast_send(self, dst: Any, tensors: Any) -> Any:
        return None

    def fast_recv(self, src: Any, out: Any) -> Any:
        """The received tensors, or None."""
        return None

    def fast_sendrecv(self, dst: Any, tensors: Any, src: Any, out: Any) -> Any:
        """The received tensors, or None."""
        return None

    def fast_gather_dim(self, fn: str, tensor: Any, dim: Any, root: Any, out: Any) -> Any:
        """all_gather / gather of a plain tensor along any dim: the result,
        NOT_PLAIN when not the case."""
        return NOT_PLAIN

    def recv_rest(self, fn: str, src: int, out: Any, header: bytes) -> list:
        """The end of a receive whose header ``fast_recv`` read and left to
        Python (only a path whose fast_recv answers with a header has one)."""
        raise NotImplementedError

    def sendrecv_rest(self, fn: str, src: int, out: Any, header: bytes, data: Any) -> list:
        """The end of a sendrecv whose message ``fast_sendrecv`` received aside."""
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

    def peer_buffers(self, fn: str, tensor: torch.Tensor) -> list:
        """Every rank's copy of an ``empty()`` tensor's buffer that this process
        maps: here only this rank's own memory."""
        return [tensor.reshape(-1).view(torch.uint8)]

    def scatter(
        self, fn: str, tensor: torch.Tensor, parts: Optional[Sequence[torch.Tensor]], src: int
    ) -> torch.Tensor:
        """``tensor`` gets ``parts[rank]`` of ``src`` (checked there): a message
        to every other rank, marked as a scatter's so that it is never taken for
        a user's send, nor one of those for it (take_message)."""
        if self.rank == src:
            for r in range(self.world):
                if r != src:
                    self.send(fn, r, [dense(parts[r].reshape(-1))], SCATTER)  # type: ignore[index]
            return tensor.copy_(parts[src].view(tensor.shape))  # type: ignore[index]
        got, tag = self.recv(fn, src)
        if tag != SCATTER:
            raise CommError(
                f"{fn}: rank {src} sent this rank a point-to-point message that was "
                f"not received yet; receive it before the scatter"
            )
        return tensor.copy_(got[0].view(tensor.shape))

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

    def recv_any(self, fn: str, out: Optional[Sequence[torch.Tensor]]) -> tuple[int, list]:
        """The next message from whichever rank's arrives first: (src, tensors)."""
        raise CommError(
            f"{fn}: receiving from any rank needs shared memory (the ranks span "
            f"hosts); name the source rank"
        )

    def try_send(self, fn: str, dst: int, tensors: Sequence[torch.Tensor]) -> bool:
        """Send only if that takes no waiting: True when sent (here: never)."""
        return False

    def send_dict(self, fn: str, dst: int, data: dict) -> None:
        """A dict of tensors and picklable values (checked): the tensors as a
        message's tensors, the rest and the keys as its picklable extra."""
        tensors, keys = [], []
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                keys.append((key, len(tensors), None))
                tensors.append(value)
            else:
                keys.append((key, None, value))
        try:
            self.send(fn, dst, tensors, keys)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"{fn}: a non-tensor value cannot be pickled: {e}") from None

    def recv_dict(self, fn: str, src: int) -> dict:
        tensors, keys = self.recv(fn, src)
        if not isinstance(keys, list):
            raise CommError(f"{fn}: rank {src} sent a tensor list, not a dict (use recv)")
        return {key: tensors[i] if i is not None else value for key, i, value in keys}

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
    error when it does not fit (a dict's or a scatter's message: Path.scatter)."""
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

    def recv_any(self, fn: str, out: Any) -> tuple[int, list]:
        raise ValueError(f"{fn}: there is no other rank to receive from (world size 1)")


LOCAL = LocalPath()

"""Groups that span hosts: shared memory inside each host, gloo between them.

The ranks of each host form a local Communicator (shared memory); the
lowest rank of each host is its leader, and the leaders form a gloo group of
their own over the set-up store.  Hosts are numbered in the order of their
lowest rank.

* all_reduce: reduce inside each host (shared memory), all-reduce between the
  leaders (gloo; bfloat16 and float16 travel as float32 there, so they round
  once more than on one host, not three times), broadcast inside each host.
  Every rank ends with the same bits.
* all_gather: gather inside each host to the leader, all-gather the host
  blocks between the leaders, broadcast inside each host, put the blocks in
  rank order (ranks of one host need not be consecutive).
* reduce_scatter: the all_reduce above, then each rank keeps its part
  (bytes between hosts: the whole tensor once per leader).
* broadcast: inside the source's host, between the leaders, inside the
  other hosts.
* barrier: inside each host, between the leaders, inside each host again.

Everything else (gather, uneven all_gather, all_to_all, point-to-point)
goes to the flat torch.distributed path of the Communicator.  A path of the
Communicator (``paths.Path``): ``should_use`` says which calls it serves.

Failures: errors of the local Communicator name local ranks; they are raised
again with the group's rank.  When the leaders' gloo group fails (a rank on
another host died: gloo sees its connection close), the leader aborts its
host's shared-memory engine before raising, so the ranks of its host waiting
for it get PeerFailedError at once instead of waiting out the timeout; gloo
does not say which rank died, so ``.rank`` is -1 there.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from . import routing
from .dist_path import DistPath, private_gloo
from .errors import CommError, CommTimeoutError, PeerFailedError
from .ops import ReduceOp, dense
from .paths import DimFirst

_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(method: _F) -> _F:
    """Translate local ranks in errors; turn a failure between hosts into
    PeerFailedError on this host's ranks too."""

    @functools.wraps(method)
    def run(self: Hierarchy, *args: Any) -> Any:
        # the whole operation (local engine and gloo) is one thread's turn
        self.local_path.hold(method.__name__)
        try:
            return method(self, *args)
        except (PeerFailedError, CommTimeoutError) as e:
            raise self._global_error(e) from None
        except CommError:
            raise
        except RuntimeError as e:  # gloo between the leaders
            self.local_path.abort()  # this host's ranks fail at once too
            raise PeerFailedError(
                f"{method.__name__}: the gloo group between the host leaders failed ({e}); "
                f"a rank on another host died or left, and this communicator can no "
                f"longer be used",
                rank=-1,
            ) from e
        finally:
            self.local_path.release()

    return run  # type: ignore[return-value]


__all__ = ["Hierarchy"]

_WIDE = (torch.bfloat16, torch.float16)


class Hierarchy(DimFirst):
    """The per-host and between-host halves of one Communicator."""

    def __init__(
        self,
        make_local: Any,
        store: Any,
        prefix: str,
        rank: int,
        world: int,
        hosts: Sequence[str],
        timeout: float,
    ):
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        self.members = [[r for r in range(world) if hosts[r] == h] for h in order]
        self.hosts = len(order)
        self.world = world
        self.rank = rank
        self.host = order.index(hosts[rank])
        self.host_of = [order.index(h) for h in hosts]
        mine = self.members[self.host]
        self.local_rank = mine.index(rank)
        # the host's Communicator, and its shared-memory path (hold, abort)
        self.local, self.local_path = make_local(
            self.local_rank, len(mine), f"{prefix}/host{self.host}", mine
        )
        self.cross: Optional[DistPath] = None
        if self.local_rank == 0:
            pg = private_gloo(store, f"{prefix}/leaders", self.host, self.hosts, timeout)
            self.cross = DistPath(pg, self.host, self.hosts, label="gloo between hosts")
        host_major = [r for m in self.members for r in m]
        self.perm: Optional[torch.Tensor] = None
        if host_major != list(range(world)):
            self.perm = torch.tensor([host_major.index(r) for r in range(world)])

    # as a path of the Communicator (routing.py)
    name = "hier"

    @property
    def why(self) -> str:
        """Why a call it does not serve leaves for torch.distributed."""
        return f"the group spans {self.hosts} hosts ({self.describe()})"

    def should_use(self, call: Any) -> Optional[str]:
        return routing.hier_objection(call, self.why)

    def describe(self) -> str:
        return "; ".join(f"host {h}: ranks {m}" for h, m in enumerate(self.members))

    def close(self) -> None:
        self.local.close()
        self.cross = None

    def _global_error(self, e: Exception) -> Exception:
        r = getattr(e, "rank", None)
        if (
            getattr(e, "_translated", False)
            or r is None
            or not 0 <= r < len(self.members[self.host])
        ):
            return e
        g = self.members[self.host][r]
        out = type(e)(f"{e} (local rank {r} of host {self.host} is rank {g})", rank=g)
        out._translated = True  # type: ignore[attr-defined]
        return out

    # -- collectives (arguments already checked by the Communicator) ----------

    @_guarded
    def all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        work = dense(t)
        step = ReduceOp.SUM if op is ReduceOp.AVG else op
        self.local.all_reduce(work, step)
        if self.cross is not None:
            if work.dtype in _WIDE:
                wide = work.float()
                self.cross.all_reduce(wide, step)
                work.copy_(wide)
            else:
                self.cross.all_reduce(work, step)
        self.local.broadcast(work, 0)
        if op is ReduceOp.AVG:
            work.div_(self.world)
        if work is not t:
            t.copy_(work)
        return t

    @_guarded
    def gather0(
        self, moved: torch.Tensor, sizes: Sequence[int], root: Optional[int]
    ) -> torch.Tensor:
        """``moved``: this rank's part, gathered dim first, the same size on every
        rank (routing sends the rest to torch.distributed); ``root`` None."""
        s, rest = moved.shape[0], tuple(moved.shape[1:])
        block = self.local.gather(moved, 0)
        if self.cross is not None:
            out = self.cross.all_gatherv(block, [len(m) * s for m in self.members])
        else:
            out = torch.empty((self.world * s, *rest), dtype=moved.dtype)
        self.local.broadcast(out, 0)
        if self.perm is not None:
            out = out.view(self.world, s, *rest)[self.perm].reshape(self.world * s, *rest)
        return out

    @_guarded
    def reduce_scatter0(self, moved: torch.Tensor, sizes: Sequence[int], op: Any) -> torch.Tensor:
        full = self.all_reduce(moved.clone(), op)
        start = sum(sizes[: self.rank])
        return full[start : start + sizes[self.rank]].clone()

    @_guarded
    def broadcast(self, fn: str, t: torch.Tensor, src: int) -> torch.Tensor:
        work = dense(t)
        src_host = self.host_of[src]
        if self.host == src_host:
            self.local.broadcast(work, self.members[src_host].index(src))
        if self.cross is not None:
            self.cross.broadcast(fn, work, src_host)
        if self.host != src_host:
            self.local.broadcast(work, 0)
        if work is not t:
            t.copy_(work)
        return t

    def all_to_all(self, fn: str, output: Any, input: Any, outs: list, ins: list) -> None:
        """Not served (should_use objects): the flat torch.distributed path's."""
        raise AssertionError(f"{fn}: routing sends all_to_all across hosts to torch.distributed")

    @_guarded
    def barrier(self, fn: str = "barrier") -> None:
        self.local.barrier()
        if self.cross is not None:
            self.cross.barrier()
        self.local.barrier()

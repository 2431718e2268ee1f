"""The Works the ``tpcomm`` backend returns, and its deferred sends and receives.

Every call of the backend but send and recv completes before it returns: its
Work is ``Done``.  Sends and receives (isend, irecv, batch_isend_irecv) wait in
their group (``Deferred``) until one of their Works is waited on, or the next
call of any tpcomm group, and then run together in one
``Communicator.batch_isend_irecv``, so no order of them can deadlock
(docs/BACKEND.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .communicator import Communicator

__all__ = ["DONE", "Deferred", "Done", "Pending", "Received", "flush_waiting"]


class Done(dist._Work):
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
DONE = Done([])


class Received(Done):
    """The Work of a receive from any source: done, and which rank sent it
    (``dist.recv(t)`` without ``src`` returns what ``_source_rank`` says)."""

    def __init__(self, result: Any, src: int):
        super().__init__(result)
        self._src = src

    def _source_rank(self) -> int:
        return self._src

    source_rank = _source_rank


class Pending(dist._Work):
    """The Work of a deferred send or recv: waiting on it runs every group's
    deferred operations first (flush_waiting)."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = result
        self._done = False
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:  # every group's, in the order they began to wait
            flush_waiting()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            flush_waiting()
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


# the groups with sends or recvs waiting: any call of any tpcomm group runs
# them first, so a rank that isends on one group and then calls a collective
# of another does not hold its message back from a receiver that must get it
# before joining that collective
_WAITING: list = []


def flush_waiting() -> None:
    """Run every group's deferred sends and receives (each group's together)."""
    for d in list(_WAITING):
        d.flush()


class Deferred:
    """One group's sends and receives not run yet: ("send" | "recv", tensors,
    peer) and their Works."""

    def __init__(self, comm: Communicator):
        self._comm = comm
        self._ops: list = []
        self._works: list = []

    def __bool__(self) -> bool:
        return bool(self._ops)

    def sends_to(self, dst: int) -> bool:
        return any(op[0] == "send" and op[2] == dst for op in self._ops)

    def add(self, what: str, tensors: list, peer: int) -> Pending:
        work = Pending(tensors)
        if not self._ops:
            _WAITING.append(self)
        self._ops.append((what, list(tensors), peer))
        self._works.append(work)
        return work

    def flush(self) -> None:
        """Run them: a send alone as a plain send, anything else together (a
        receive whose message does not fit gets its error in its Work)."""
        ops, works = self._ops, self._works
        self._ops, self._works = [], []
        if self in _WAITING:
            _WAITING.remove(self)
        if not ops:
            return
        try:
            if len(ops) == 1 and ops[0][0] == "send":  # the ordinary path
                self._comm.send(ops[0][1], ops[0][2])
                errors = [None]
            else:
                errors = self._comm.batch_isend_irecv(ops)
        except BaseException as e:
            for w in works:
                w.finish(e)
            raise
        for w, e in zip(works, errors):
            w.finish(e)

"""The floor under any Python ProcessGroup: dist.all_reduce on one that does nothing.

torch.distributed's own Python wrapper (argument checks, logging decorators,
options objects) runs before a ProcessGroup's method is called; this times it
with a group whose allreduce returns at once, so that `tpcomm perf all_reduce
--backend dist` can be read as: torch's wrapper + the tpcomm ProcessGroup +
the Communicator.  It then times tpcomm's ProcessGroup method alone (its
Communicator replaced by a no-op).  Run: .venv/bin/python benchmarks/pg_floor.py
"""

import os
import socket
import time

import torch
import torch.distributed as dist


class _Done(dist._Work):
    def wait(self, timeout=None):
        return True


_DONE = _Done()


class NoopGroup(dist.ProcessGroup):
    def allreduce(self, tensors, opts):
        return _DONE

    def getBackendName(self):
        return "noop"


def main():
    dist.Backend.register_backend("noop", lambda s, r, w, t: NoopGroup(r, w), devices=["cpu"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("noop", rank=0, world_size=1)
    x = torch.ones(256)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50000):
            dist.all_reduce(x)
        best = min(best, (time.perf_counter() - t0) / 50000)
    print(f"dist.all_reduce on a no-op Python ProcessGroup, 1 KiB: {best * 1e6:.2f} us")
    dist.destroy_process_group()
    _tpcomm_layer(x)


class _NoComm:
    """Stands in for the Communicator: all_reduce is a C builtin that does nothing."""

    all_reduce = staticmethod(id)


def _tpcomm_layer(x):
    """ProcessGroupTpcomm.allreduce's own cost: the method with its Communicator
    replaced by a no-op, against the no-op called directly, in alternating
    blocks (the difference is the layer; no peer, so no waiting in it)."""
    from torch.distributed.distributed_c10d import AllreduceOptions

    import tpcomm  # noqa: F401  (registers the backend)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("tpcomm", rank=0, world_size=1)
    pg = dist.group.WORLD
    real, pg._comm = pg._comm, _NoComm()
    noop = _NoComm.all_reduce
    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    diffs = []
    try:
        for _ in range(41):
            t0 = time.perf_counter()
            for _ in range(5000):
                pg.allreduce([x], opts)
            t1 = time.perf_counter()
            for _ in range(5000):
                noop(x)
            t2 = time.perf_counter()
            diffs.append(((t1 - t0) - (t2 - t1)) / 5000)
    finally:
        pg._comm = real
        dist.destroy_process_group()
    diffs.sort()
    print(
        "ProcessGroupTpcomm.allreduce over a direct call (the layer's own cost, "
        f"median of 41 alternating blocks): {diffs[20] * 1e6:.2f} us "
        f"(quartiles {diffs[10] * 1e6:.2f}-{diffs[30] * 1e6:.2f})"
    )


if __name__ == "__main__":
    main()

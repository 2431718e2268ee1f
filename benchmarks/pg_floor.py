"""The floor under any Python ProcessGroup: dist.all_reduce on one that does nothing.

torch.distributed's own Python wrapper (argument checks, logging decorators,
options objects) runs before a ProcessGroup's method is called; this times it
with a group whose allreduce returns at once, so that `tpcomm perf all_reduce
--backend dist` can be read as: torch's wrapper + the tpcomm ProcessGroup +
the Communicator.  Run: .venv/bin/python benchmarks/pg_floor.py
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


if __name__ == "__main__":
    main()

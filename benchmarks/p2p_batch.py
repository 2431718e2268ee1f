"""batch_isend_irecv exchanges over the tpcomm backend and over gloo, same ranks.

Two ranks each send the other a tensor and receive one of the same size in one
``dist.batch_isend_irecv`` (what pipeline parallelism does between stages);
time per exchange, the slower rank's, tpcomm then gloo on the same data.
Messages above the pair channel's ring (1 MiB at world size 2) used to
deadlock over tpcomm (docs/BACKEND.md).  Run: .venv/bin/python
benchmarks/p2p_batch.py
"""

import socket
import time

import torch
import torch.distributed as dist

import tpcomm

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24]


def _exchange(x, y, peer, group):
    ops = [dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, y, peer, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _time(x, y, peer, group, iters):
    for _ in range(3):
        _exchange(x, y, peer, group)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        _exchange(x, y, peer, group)
    return (time.perf_counter() - t0) / iters


def run(comm, port):
    torch.set_num_threads(1)
    dist.init_process_group(
        "cpu:tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=2
    )
    try:
        gloo = dist.new_group(backend="gloo")
        peer = 1 - comm.rank
        rows = []
        for nbytes in SIZES:
            n = nbytes // 4
            x = torch.full((n,), float(comm.rank))
            y = torch.zeros(n)
            iters = max(5, min(2000, (64 << 20) // nbytes))
            mine = _time(x, y, peer, None, iters)
            ok = bool((y == peer).all())
            y.zero_()
            theirs = _time(x, y, peer, gloo, max(5, iters // 10))
            ok = ok and bool((y == peer).all())
            rows.append((nbytes, mine, theirs, ok))
        return rows
    finally:
        dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = tpcomm.launch(run, 2, args=(port,), timeout=600)
    print("# batch_isend_irecv, 2 ranks, each sends and receives `bytes` per exchange")
    print("#     bytes  tpcomm(us)   gloo(us)  speedup  correct")
    for a, b in zip(*res):
        mine, theirs = max(a[1], b[1]), max(a[2], b[2])
        print(
            f"{a[0]:>11} {mine * 1e6:>11.1f} {theirs * 1e6:>10.1f} "
            f"{theirs / mine:>7.1f}x  {a[3] and b[3]}"
        )


if __name__ == "__main__":
    main()

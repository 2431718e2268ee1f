"""Timing table for scripts/gpu_check.sh: custom one-shot / two-shot vs torch.distributed.

Ranks share GPU 0, as in the tests.  Without MPS, kernels of different
processes time-slice on one GPU rather than run side by side, so these are
not the numbers of one rank per GPU; they show the path works end to end and
what it costs here.  torch.distributed is gloo on the same CUDA tensors (NCCL
refuses two ranks on one GPU).
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist

import tpcomm
from tpcomm.cuda import CustomAllreduce


def _time_us(comm, dev, call, warmup, iters):
    """Microseconds per call on the GPU, after ``warmup`` calls and a barrier."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize(dev)
    comm.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        call()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def _rank(comm, port, sizes, iters):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.world_size
    )
    car = CustomAllreduce(comm, dev, max_size=8 << 20)
    rows = []
    try:
        if car.disabled:
            return [("disabled", car.disabled_reason)]
        for nbytes in sizes:
            x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
            row = [nbytes]
            for algo in ("one_shot", "two_shot"):
                car.algorithm = algo
                row.append(_time_us(comm, dev, lambda x=x: car.all_reduce(x), 3, iters))
            row.append(_time_us(comm, dev, lambda x=x: dist.all_reduce(x), 2, max(3, iters // 10)))
            rows.append(row)
        return rows
    finally:
        car.close()
        dist.destroy_process_group()


def main() -> int:
    sizes = [1 << k for k in (10, 14, 16, 18, 20, 22)]
    for world in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        res = tpcomm.launch(_rank, world, args=(port, sizes, 20), timeout=240)
        print(f"\n# world {world}, bfloat16, ranks sharing {torch.cuda.get_device_name(0)}")
        if res[0] and res[0][0] == "disabled":
            print(f"# custom all-reduce disabled: {res[0][1]}")
            continue
        print(f"# {'bytes':>9} {'one-shot(us)':>13} {'two-shot(us)':>13} {'gloo(us)':>10}")
        for i, row in enumerate(res[0]):
            worst = [max(r[i][j] for r in res) for j in range(1, 4)]
            print(f"  {row[0]:>9} {worst[0]:>13.1f} {worst[1]:>13.1f} {worst[2]:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Ways in: inside a torch.distributed job (world and sub-groups, several
communicators in one process), and from torchrun-style environment variables.
Results are compared with gloo on the same data."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tpcomm

from ._helpers import free_port, torchrun_env


def in_dist_job(comm, port):
    rank, world = comm.rank, comm.world_size
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out = {}
        g01 = dist.new_group([0, 1])
        g23 = dist.new_group([2, 3])
        mine = g01 if rank < 2 else g23
        with tpcomm.Communicator() as cw, tpcomm.Communicator(mine, timeout=30) as cs:
            out["world"] = (cw.rank, cw.world_size, cs.rank, cs.world_size)
            x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
            y = x.clone()
            cw.all_reduce(x)
            dist.all_reduce(y)
            out["world_equal"] = torch.equal(x, y)
            # interleave the two communicators
            for k in range(3):
                a = torch.full((77,), float(rank + k), dtype=torch.float32)
                b = a.clone()
                cs.all_reduce(a, tpcomm.ReduceOp.MAX)
                dist.all_reduce(b, op=dist.ReduceOp.MAX, group=mine)
                c = torch.full((5,), rank + k, dtype=torch.int64)
                cw.all_reduce(c)
                out.setdefault("sub_equal", []).append(torch.equal(a, b))
                out.setdefault("world_ints", []).append(c.tolist())
            # different collectives interleaved across the two communicators
            for k in range(3):
                g = cs.all_gather(torch.tensor([rank, k]))
                v = torch.full((3,), float(k))
                cw.all_reduce(v)
                bb = torch.full((2,), float(rank))
                cs.broadcast(bb, src=1)
                out.setdefault("interleaved", []).append((g.tolist(), v.tolist(), bb.tolist()))
            cw.barrier()
            # a dup of the sub-group's communicator: its own engine, the same ranks;
            # its fallback is the same torch.distributed group (float64 goes there)
            with cs.dup() as cd:
                z = torch.full((4,), float(rank), dtype=torch.float64)
                cd.all_reduce(z)
                out["dup"] = (
                    cd.rank,
                    cd.world_size,
                    cd._shm.engine is not cs._shm.engine,
                    z.tolist(),
                )
        return out
    finally:
        dist.destroy_process_group()


def test_communicator_in_torch_distributed_job():
    world = 4
    res = tpcomm.launch(in_dist_job, world, args=(free_port(),), timeout=120)
    for r, out in enumerate(res):
        assert out["world"] == (r, 4, r % 2, 2)
        assert out["world_equal"]
        assert out["sub_equal"] == [True] * 3
        assert out["world_ints"] == [[6 + 4 * k] * 5 for k in range(3)]
        base = 0 if r < 2 else 2
        base_sum = float(2 * (0 if r < 2 else 2) + 1)
        assert out["dup"] == (r % 2, 2, True, [base_sum] * 4)
        assert out["interleaved"] == [
            ([base, k, base + 1, k], [4.0 * k] * 3, [float(base + 1)] * 2) for k in range(3)
        ]


def from_env(comm, port):
    torchrun_env(comm, port)
    with tpcomm.Communicator.from_env(timeout=30) as c:
        x = torch.full((1000,), float(c.rank))
        c.all_reduce(x, tpcomm.ReduceOp.AVG)
        with c.dup() as d:  # over the same TCPStore
            y = d.all_reduce(torch.ones(3))
        return c.rank, c.world_size, x[0].item(), y.tolist()


def test_from_env():
    res = tpcomm.launch(from_env, 3, args=(free_port(),), timeout=120)
    assert res == [(r, 3, 1.0, [3.0] * 3) for r in range(3)]

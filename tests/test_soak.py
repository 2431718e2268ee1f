"""A random program of every operation, checked step by step against torch.

Every rank draws the same sequence of operations from one seed (kind, dtype,
shape, dim, root, op, size class from empty to several slots) and the data of
every rank from (seed, rank, step), so each rank computes the reference for
the whole group locally (tests/_ref.py: float32 accumulation in rank order,
one rounding). One long sequence exercises what separate tests do not: the
channels, slots, parities and round counters of many different operations
following each other, small and large, fast paths and general paths, with
p2p interleaved between collectives.
"""

from __future__ import annotations

import random

import pytest
import torch

import tpcomm

from ._ref import DTYPES, MOVE_DTYPES, make, reference

SIZES = [0, 1, 7, 300, 4099, 70_000, 400_001]  # up to several 1 MiB slots of float32


def _shape(rng: random.Random, numel: int, w: int) -> tuple:
    """A 1-3 dim shape of about numel elements whose first dim divides by w."""
    nd = rng.choice([1, 2, 3])
    if nd == 1:
        return (w * max(numel // w, 0),)
    if nd == 2:
        return (w * rng.choice([1, 2]), max(numel // (2 * w), 0))
    return (w, rng.choice([1, 3]), max(numel // (3 * w), 0))


def program(comm, seed: int, steps: int):
    rng = random.Random(seed)
    r, w = comm.rank, comm.world_size
    bad = []

    def check(step, what, got, want):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        if not same:
            bad.append(f"step {step} {what}: {got.dtype} {tuple(got.shape)} vs {tuple(want.shape)}")

    for step in range(steps):
        kind = rng.choice(
            ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "gather", "sendrecv"]
            + ["p2p", "barrier", "all_gatherv", "all_reduce strided", "all_to_all", "scatter"]
            + ["recv_any", "empty"]
        )
        numel = rng.choice(SIZES)
        sd = seed * 100_000 + step
        if kind == "empty":  # an all_reduce of a comm.empty() tensor reads the peers in place
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
            xs = [make(q, numel, dtype, sd) for q in range(w)]
            t = comm.empty((numel,), dtype)
            t.copy_(xs[r])
            check(step, f"{kind} {dtype}", comm.all_reduce(t), reference(xs, tpcomm.ReduceOp.SUM))
            continue
        if kind in ("all_reduce", "all_reduce strided", "reduce_scatter"):
            dtype = rng.choice(DTYPES)
            ops = list(tpcomm.ReduceOp)
            if dtype in (torch.int32, torch.int64):
                ops.remove(tpcomm.ReduceOp.AVG)
            op = rng.choice(ops)
            shape = _shape(rng, numel, w)
            xs = [make(q, shape, dtype, sd) for q in range(w)]
            want = reference(xs, op)
            if kind == "all_reduce":
                check(step, f"{kind} {dtype} {op.name}", comm.all_reduce(xs[r].clone(), op), want)
            elif kind == "all_reduce strided":
                wide = torch.zeros((*shape, 2), dtype=dtype)
                view = wide[..., 0]
                view.copy_(xs[r])
                check(step, f"{kind} {dtype} {op.name}", comm.all_reduce(view, op), want)
                check(step, f"{kind} untouched", wide[..., 1], torch.zeros(shape, dtype=dtype))
            else:
                d = rng.randrange(len(shape)) if shape[0] % w == 0 else 0
                if shape[d] % w:
                    d = 0
                part = shape[d] // w
                got = comm.reduce_scatter(xs[r], dim=d, op=op)
                check(
                    step, f"{kind} {dtype} {op.name} dim {d}", got, want.narrow(d, r * part, part)
                )
            continue
        dtype = rng.choice(MOVE_DTYPES)
        shape = _shape(rng, numel, w)
        xs = [make(q, shape, dtype, sd) for q in range(w)]
        if kind == "all_gather":
            d = rng.randrange(-len(shape), len(shape))
            check(step, f"{kind} {dtype} dim {d}", comm.all_gather(xs[r], dim=d), torch.cat(xs, d))
        elif kind == "all_gatherv":
            sizes = [rng.randrange(0, 5) for _ in range(w)]
            parts = [make(q, (sizes[q], 3), dtype, sd) for q in range(w)]
            check(step, f"{kind} {dtype}", comm.all_gatherv(parts[r], sizes), torch.cat(parts))
        elif kind == "broadcast":
            src = rng.randrange(w)
            check(step, f"{kind} {dtype} src {src}", comm.broadcast(xs[r].clone(), src), xs[src])
        elif kind == "gather":
            dst = rng.randrange(w)
            got = comm.gather(xs[r], dst=dst)
            if r == dst:
                check(step, f"{kind} {dtype} dst {dst}", got, torch.cat(xs))
            elif got is not None:
                bad.append(f"step {step} gather: a tensor on a rank that is not dst")
        elif kind == "sendrecv":
            shift = rng.randrange(1, w) if w > 1 else 0
            got = comm.sendrecv([xs[r], xs[r][:1]], (r + shift) % w, (r - shift) % w)
            q = (r - shift) % w
            check(step, f"{kind} {dtype}", got[0], xs[q])
            check(step, f"{kind} {dtype} second", got[1], xs[q][:1])
        elif kind == "p2p":  # rank 0 sends every other rank a message, they answer
            if r == 0:
                for q in range(1, w):
                    comm.send([xs[0]], q)
                for q in range(1, w):
                    check(step, f"{kind} {dtype} from {q}", comm.recv(q)[0], xs[q])
            else:
                check(step, f"{kind} {dtype} to {r}", comm.recv(0)[0], xs[0])
                comm.send([xs[r]], 0)
        elif kind == "all_to_all":  # uneven splits, the same table on every rank
            splits = [[rng.randrange(0, 4) for _ in range(w)] for _ in range(w)]
            rows = [make(q, (sum(splits[q]), 3), dtype, sd) for q in range(w)]
            ins, outs = splits[r], [splits[q][r] for q in range(w)]
            got = comm.all_to_all_single(torch.empty(sum(outs), 3, dtype=dtype), rows[r], outs, ins)
            want = torch.cat(
                [rows[q].split(splits[q])[r] for q in range(w)]
            )  # fmt: skip
            check(step, f"{kind} {dtype}", got, want)
        elif kind == "scatter":
            src = rng.randrange(w)
            parts = [make(q, shape, dtype, sd + 7) for q in range(w)]
            got = comm.scatter(torch.empty(shape, dtype=dtype), parts if r == src else None, src)
            check(step, f"{kind} {dtype} src {src}", got, parts[r])
        elif kind == "recv_any":  # every other rank sends rank 0 one message
            if r == 0:
                for _ in range(w - 1):
                    q, (got,) = comm.recv_any()
                    check(step, f"{kind} {dtype} from {q}", got, xs[q])
            else:
                comm.send([xs[r]], 0)
            comm.barrier()
        else:
            comm.barrier()
    return bad


@pytest.mark.parametrize(
    "world,seed,steps", [(2, 11, 200), (3, 12, 200), (4, 13, 150), (8, 14, 60)]
)
def test_a_random_program_matches_torch(pools, world, seed, steps):
    for rank, bad in enumerate(pools.run(world, program, seed, steps)):
        assert bad == [], (rank, bad[:5])

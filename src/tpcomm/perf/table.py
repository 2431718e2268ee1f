"""The collective table of ``tpcomm perf`` (nccl-tests' vtable): per collective
its bus-bandwidth factor, how its data is made, the tpcomm and torch.distributed
calls, and the expected result; plus the data and sizes they share."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..ops import FLOAT_DTYPES, ReduceOp

__all__ = [
    "COLLECTIVES", "DTYPES", "GROUP", "REDUCING", "TYPE_NAMES", "Collective", "concat", "data",
    "dist_group", "dist_op", "expected", "in_place", "parse_size", "torch_dist",
]  # fmt: skip

DTYPES = {
    "float": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
}
TYPE_NAMES = {
    torch.float32: "float",
    torch.bfloat16: "bfloat16",
    torch.float16: "half",
    torch.int32: "int32",
    torch.int64: "int64",
}


def parse_size(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '3' -> 3 (binary suffixes, like nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)[Bb]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 8, 1K, 64M, 1G)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


@dataclass
class Collective:
    """One entry of the vtable: sizes, data, the two implementations, the check.

    ``parts`` is how many equal pieces the size splits into (all_gather,
    reduce_scatter and gather move size/n per rank, like nccl-tests);
    ``make(rank, world, count, dtype, op, salt)`` returns the call's state
    (inputs and outputs); ``bind(comm, op)`` returns ``run(st)``, which
    performs it in one frame (as the MPI side's ``run(st)`` does: the harness
    costs every library alike), and ``run_dist(st, op)`` through
    torch.distributed; ``expect(world, count, dtype, op, salt, rank)`` is the
    output this rank must hold afterwards (None: nothing to check), ``out(st)``
    that output.
    """

    name: str
    busbw_factor: Callable[[int], float]
    parts: bool
    root: int
    make: Callable[..., dict]
    bind: Callable[..., Callable[[dict], Any]]
    run_dist: Callable[..., Any]
    expect: Callable[..., Any]
    out: Callable[[dict], Any]


def torch_dist():
    import torch.distributed as dist

    return dist


# the group the torch.distributed side runs on (None: the default group)
GROUP: list = [None]


def dist_group():
    return GROUP[0]


def dist_op(op: ReduceOp):
    return getattr(torch_dist().ReduceOp, op.name)


def _gloo_gather_into(out, x):
    dist = torch_dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=dist_group())


def _gloo_reduce_scatter(out, x, op):
    dist = torch_dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist_op(op), group=dist_group())


def _sendrecv(comm):
    # as nccl-tests' sendrecv: every rank sends to the next and receives from
    # the previous one at once (MPI_Sendrecv; gloo: isend, then recv), into a
    # buffer it reuses; the ranks worked out once, as the MPI side does
    n, r = comm.world_size, comm.rank
    dst, src = (r + 1) % n, (r - 1) % n
    return lambda st: comm.sendrecv([st["x"]], dst, src, out=[st["y"]])


def _sendrecv_dist(st):
    dist = torch_dist()
    n, r = dist.get_world_size(), dist.get_rank()
    req = dist.isend(st["x"], (r + 1) % n, group=dist_group())
    dist.recv(st["y"], (r - 1) % n, group=dist_group())
    req.wait()


def concat(world, count, dtype, salt):
    return torch.cat([data(q, count // world, dtype, salt) for q in range(world)])


COLLECTIVES = {
    "all_reduce": Collective(
        name="all_reduce",
        busbw_factor=lambda n: 2 * (n - 1) / n,
        parts=False,
        root=-1,
        make=lambda r, w, c, dt, op, salt: {"x": data(r, c, dt, salt)},
        bind=lambda comm, op: lambda st: comm.all_reduce(st["x"], op),
        run_dist=lambda st, op: torch_dist().all_reduce(
            st["x"], op=dist_op(op), group=dist_group()
        ),
        expect=lambda w, c, dt, op, salt, r: expected(w, c, dt, op, salt),
        out=lambda st: st["x"],
    ),
    "all_gather": Collective(
        name="all_gather",
        busbw_factor=lambda n: (n - 1) / n,
        parts=True,
        root=-1,
        make=lambda r, w, c, dt, op, salt: {
            "x": data(r, c // w, dt, salt),
            "y": torch.empty(c, dtype=dt),
        },
        bind=lambda comm, op: lambda st: comm.all_gather_into_tensor(st["y"], st["x"]),
        run_dist=lambda st, op: _gloo_gather_into(st["y"], st["x"]),
        expect=lambda w, c, dt, op, salt, r: concat(w, c, dt, salt),
        out=lambda st: st["y"],
    ),
    "reduce_scatter": Collective(
        name="reduce_scatter",
        busbw_factor=lambda n: (n - 1) / n,
        parts=True,
        root=-1,
        make=lambda r, w, c, dt, op, salt: {
            "x": data(r, c, dt, salt),
            "y": torch.empty(c // w, dtype=dt),
        },
        bind=lambda comm, op: lambda st: comm.reduce_scatter_tensor(st["y"], st["x"], op),
        run_dist=lambda st, op: _gloo_reduce_scatter(st["y"], st["x"], op),
        expect=lambda w, c, dt, op, salt, r: expected(w, c, dt, op, salt).chunk(w)[r],
        out=lambda st: st["y"],
    ),
    "broadcast": Collective(
        name="broadcast",
        busbw_factor=lambda n: 1.0,
        parts=False,
        root=0,
        make=lambda r, w, c, dt, op, salt: {"x": data(r, c, dt, salt)},
        bind=lambda comm, op: lambda st: comm.broadcast(st["x"], 0),
        run_dist=lambda st, op: torch_dist().broadcast(st["x"], 0, group=dist_group()),
        expect=lambda w, c, dt, op, salt, r: data(0, c, dt, salt),
        out=lambda st: st["x"],
    ),
    "gather": Collective(
        name="gather",
        busbw_factor=lambda n: (n - 1) / n,
        parts=True,
        root=0,
        # every side gathers into buffers it allocated once: tpcomm into `out`,
        # gloo into its gather_list, MPI into one buffer (tpcomm.perf.mpi_rank)
        make=lambda r, w, c, dt, op, salt: {
            "x": data(r, c // w, dt, salt),
            "y": [torch.empty(c // w, dtype=dt) for _ in range(w)] if r == 0 else None,
            "o": torch.empty(c, dtype=dt) if r == 0 else None,
        },
        bind=lambda comm, op: lambda st: st.__setitem__("g", comm.gather(st["x"], 0, out=st["o"])),
        run_dist=lambda st, op: torch_dist().gather(st["x"], st["y"], dst=0, group=dist_group()),
        expect=lambda w, c, dt, op, salt, r: concat(w, c, dt, salt) if r == 0 else None,
        out=lambda st: st.get("g"),
    ),
    "sendrecv": Collective(
        name="sendrecv",
        busbw_factor=lambda n: 1.0,
        parts=False,
        root=-1,
        make=lambda r, w, c, dt, op, salt: {
            "x": data(r, c, dt, salt),
            "y": torch.empty(c, dtype=dt),
        },
        bind=lambda comm, op: _sendrecv(comm),
        run_dist=lambda st, op: _sendrecv_dist(st),
        expect=lambda w, c, dt, op, salt, r: data((r - 1) % w, c, dt, salt),
        out=lambda st: st["y"],
    ),
}
REDUCING = ("all_reduce", "reduce_scatter")


def in_place(name: str, st: dict, rank: int) -> dict:
    """--in-place: all_gather's input moved into its own chunk of the output
    (torch's in-place all_gather_into_tensor, nccl-tests' in-place run)."""
    if name == "all_gather":
        x, y = st["x"], st["y"]
        own = y[rank * x.numel() : (rank + 1) * x.numel()]
        own.copy_(x)
        st["x"] = own
    return st


def data(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Small integers: exact in every dtype, different per rank and per element."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + rank * 3 + salt) % 13
    return base.to(dtype)


def expected(world: int, count: int, dtype: torch.dtype, op: ReduceOp, salt: int) -> torch.Tensor:
    acc_dtype = torch.float32 if dtype in FLOAT_DTYPES else dtype
    acc = data(0, count, dtype, salt).to(acc_dtype)
    for r in range(1, world):
        x = data(r, count, dtype, salt).to(acc_dtype)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + x
        elif op is ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op is ReduceOp.AVG:
        acc = acc / world
    return acc.to(dtype)

"""The MPI side of ``tpcomm perf --compare mpi``: the same collective, sizes and
data through mpi4py, run under ``mpirun`` by the perf command.

Each rank pins itself the way tpcomm perf pins its ranks (rank r on CPU
r mod #cpus), times the call with the same loop (warm-up, a 5-call probe, an
iteration count agreed across ranks, a barrier, the timed loop), checks the
result against the same reference on fresh data, and rank 0 prints one JSON
line: ``{"library": ..., "rows": [{"size", "time", "wrong"}, ...]}``; a row
whose dtype or op MPI lacks (bfloat16, float16, AVG) has ``"time": null``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ..ops import ReduceOp
from .mpi import MPI_DTYPES, MPI_OPS
from .table import COLLECTIVES, concat, in_place
from .timing import loop_timed, timed


def supported(dtype: torch.dtype, op: str) -> bool:
    return dtype in MPI_DTYPES and op in MPI_OPS


def _calls(MPI, comm, name: str, mpi_op, inplace: bool = False):
    """(make, run, out) for one collective, on numpy views of torch tensors;
    inplace: perf's --in-place (all_gather with MPI_IN_PLACE)."""
    coll = COLLECTIVES[name]
    rank, world = comm.rank, comm.size

    def make(count, dtype, salt):
        st = coll.make(rank, world, count, dtype, ReduceOp.SUM, salt)
        if inplace:
            st = in_place(name, st, rank)
        if name == "gather":  # one flat receive buffer on the root instead of a list
            st["y"] = torch.empty(count, dtype=dtype) if rank == 0 else None
        # numpy views made once, outside the timed loop (t.numpy() costs ~0.5 us)
        st["np"] = {k: v.numpy() for k, v in st.items() if isinstance(v, torch.Tensor)}
        return st

    if name == "all_reduce":

        def run(st):
            comm.Allreduce(MPI.IN_PLACE, st["np"]["x"], op=mpi_op)

    elif name == "all_gather" and inplace:

        def run(st):
            comm.Allgather(MPI.IN_PLACE, st["np"]["y"])

    elif name == "all_gather":

        def run(st):
            comm.Allgather(st["np"]["x"], st["np"]["y"])

    elif name == "reduce_scatter":

        def run(st):
            comm.Reduce_scatter_block(st["np"]["x"], st["np"]["y"], op=mpi_op)

    elif name == "broadcast":

        def run(st):
            comm.Bcast(st["np"]["x"], root=0)

    elif name == "gather":

        def run(st):
            comm.Gather(st["np"]["x"], st["np"]["y"] if rank == 0 else None, root=0)

    elif name == "sendrecv":
        # as tpcomm's side (table._sendrecv): to the next rank, from the previous
        dst, src = (rank + 1) % world, (rank - 1) % world

        def run(st):
            comm.Sendrecv(st["np"]["x"], dst, recvbuf=st["np"]["y"], source=src)

    else:  # pragma: no cover - the perf command only passes known names
        raise ValueError(f"no MPI call for {name!r}")

    def out(st):
        return st["y"] if name == "gather" else coll.out(st)

    return make, run, out


def _expect(name, world, count, dtype, op, salt, rank):
    if name == "gather":
        return concat(world, count, dtype, salt) if rank == 0 else None
    return COLLECTIVES[name].expect(world, count, dtype, ReduceOp[op], salt, rank)


def main(cfg: dict) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    torch.set_num_threads(1)
    if cfg["pin"]:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dtype = getattr(torch, cfg["dtype"])
    op = cfg["op"]
    name = cfg["collective"]
    coll = COLLECTIVES[name]
    es = torch.empty(0, dtype=dtype).element_size()
    rows = []
    if not supported(dtype, op):
        rows = [{"size": s, "time": None, "wrong": None} for s in cfg["sizes"]]
    else:
        make, run, out = _calls(MPI, comm, name, getattr(MPI, op), cfg.get("in_place", False))
        for i, size in enumerate(cfg["sizes"]):
            count = max(1, size // es)
            if coll.parts:
                count = max(world, count // world * world)
            st = make(count, dtype, 0)
            for _ in range(cfg["warmup"]):
                run(st)
            if i == 0:  # as tpcomm.perf: ~0.2 s more of calls absorb start-up
                probe = timed(lambda st=st: run(st), 5)
                for _ in range(
                    comm.allreduce(int(min(100000, 0.2 / max(probe, 1e-7))), op=MPI.MAX)
                ):
                    run(st)
            iters = cfg["iters"]
            if iters <= 0:
                probe = timed(lambda st=st: run(st), 5)
                iters = int(min(200000, max(20, cfg["target"] / max(probe, 1e-7))))
                iters = comm.allreduce(iters, op=MPI.MAX)
            mine = loop_timed(run, st, iters, comm.Barrier, cfg, rank, world)
            elapsed = comm.allreduce(mine, op=MPI.MAX)
            wrong = 0
            for salt in range(1, cfg["check"] + 1):
                chk = make(count, dtype, salt)
                run(chk)
                want = _expect(name, world, count, dtype, op, salt, rank)
                if want is not None:
                    wrong += int((out(chk).reshape(-1) != want.reshape(-1)).sum())
            wrong = comm.allreduce(wrong, op=MPI.SUM)
            rows.append({"size": count * es, "time": elapsed, "wrong": wrong})
            comm.Barrier()
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        print(json.dumps({"library": library, "rows": rows}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

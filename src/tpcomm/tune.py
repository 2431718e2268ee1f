"""``tpcomm tune``: measure on this machine where each all-reduce algorithm
(one-shot, two-shot, single copy; bfloat16's one-shot and two-shot apart, for
both 16-bit floats) and the single-copy all_gather win, for the world sizes
given, and write the switch points as a profile
(:mod:`tpcomm.shm.profile`) that every Communicator made here then uses.

Every algorithm runs on the same ranks and data, in turns (the order turning
each repetition); the table's fastest is the lowest median time, and a
switch point is the smallest measured size at which the other algorithm is
faster by 3 % or more (the median of each repetition's own ratio) and at every
larger size not slower by more than 3 % (-1: never).  Settings given in the
environment still win over the profile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from .ops import ReduceOp
from .perf.table import parse_size
from .perf.timing import agree, timed

__all__ = ["add_arguments", "main", "run", "switch_point"]

ALL_REDUCE = ("one-shot", "two-shot", "single-copy")
ALL_GATHER = ("copy", "single-copy")
# what is timed: all_reduce of float32 (its switch points serve the integers
# too), of bfloat16 (the switch point of both 16-bit floats, whose reduce costs
# more, so splitting it between the ranks can pay earlier), all_gather
MEASURED = (
    ("all_reduce", ALL_REDUCE, torch.float32),
    ("all_reduce_bf16", ALL_REDUCE[:2], torch.bfloat16),
    ("all_gather", ALL_GATHER, torch.float32),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-N", "--nranks", default="2", help="world sizes to measure, comma-separated (default 2)"
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-R", "--repeat", type=int, default=5, help="repetitions (the order turns)")
    p.add_argument("--target", type=float, default=0.05, help="seconds per algorithm and size")
    p.add_argument("--no-pin", action="store_true", help="do not pin rank r to CPU r")
    p.add_argument("-o", "--output", help="the profile (default: TPCOMM_PROFILE or the cache's)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")


# a ratio within this of 1 is a tie: the run-to-run noise of a shared machine
MARGIN = 0.03


def switch_point(sizes: list, ratios: list, margin: float = MARGIN) -> int:
    """The smallest size at which the other algorithm takes at most 1 - margin
    of the time and at every larger size at most 1 + margin (-1: none).
    ``ratios``: its time over the current one's, per size."""
    point = -1
    for size, ratio in reversed(list(zip(sizes, ratios))):
        if ratio > 1 + margin:
            break
        if ratio <= 1 - margin:
            point = size
    return point


def _use(comm: Any, collective: str, algo: str) -> None:
    from . import _testing

    if collective.startswith("all_reduce"):
        _testing.set_twoshot_min(comm, 0 if algo == "two-shot" else -1)
        _testing.set_cma_allreduce_min(comm, 0 if algo == "single-copy" else -1)
    else:
        _testing.cma_init(comm, algo == "single-copy", 0)


def _measure(comm: Any, cfg: dict) -> dict:
    """One rank: {collective: {size: {algorithm: [seconds per call, per repetition]}}}."""
    from . import _env, _testing

    torch.set_num_threads(1)
    w = comm.world_size
    # single copy only where this machine lets the ranks read each other
    cma = _testing.cma_init(comm, True, 0)[1]
    out: dict = {"single_copy_possible": cma}
    try:
        for collective, algos, dtype in MEASURED:
            out[collective] = {}
            algos = [a for a in algos if cma or a != "single-copy"]
            for size in cfg["sizes"]:
                n = max(w, size // dtype.itemsize // w * w)
                x = torch.rand(n if collective != "all_gather" else n // w).to(dtype)
                fn = comm.all_gather if collective == "all_gather" else comm.all_reduce

                def call(fn=fn, x=x) -> None:
                    fn(x)

                times: dict = {a: [] for a in algos}
                for rep in range(cfg["repeat"]):
                    turn = rep % len(algos)
                    for algo in algos[turn:] + algos[:turn]:
                        _use(comm, collective, algo)
                        call()
                        probe = timed(call, 2)
                        iters = agree(comm, max(3, int(cfg["target"] / max(probe, 1e-7))))
                        comm.barrier()
                        times[algo].append(timed(call, iters))
                out[collective][size] = _worst(comm, times)
    finally:
        _testing.set_twoshot_min(comm, None)
        _testing.set_cma_allreduce_min(comm, None)
        _testing.cma_init(comm, *_env.cma_plan(w))
    return out


def _worst(comm: Any, times: dict) -> dict:
    """Each repetition's time as the slowest rank saw it."""
    out = {}
    for algo, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float32)
        comm.all_reduce(t, ReduceOp.MAX)
        out[algo] = t.tolist()
    return out


def _settings(sizes: list, res: dict) -> tuple:
    """The switch points from one world's measurements, and a table per collective."""

    def median(collective: str, size: int, algo: str) -> float:
        return statistics.median(res[collective][size][algo])

    def ratios(collective: str, algo: str, *base: str) -> list:
        """Per size, the median over the repetitions of each one's own
        ratio: algo's time over the fastest of base's."""
        out = []
        for s in sizes:
            t = res[collective][s]
            reps = range(len(t[algo]))
            out.append(statistics.median(t[algo][r] / min(t[b][r] for b in base) for r in reps))
        return out

    settings = {
        "twoshot_min_bytes": switch_point(sizes, ratios("all_reduce", "two-shot", "one-shot")),
        "twoshot_min_bytes_16bit": switch_point(
            sizes, ratios("all_reduce_bf16", "two-shot", "one-shot")
        ),
    }
    if res["single_copy_possible"]:
        ar = ratios("all_reduce", "single-copy", "one-shot", "two-shot")
        settings["cma_allreduce_min_bytes"] = switch_point(sizes, ar)
        ag = ratios("all_gather", "single-copy", "copy")
        settings["cma_min_bytes"] = switch_point(sizes, ag)
    lines = []
    for collective, algos, _ in MEASURED:
        algos = [a for a in algos if a in res[collective][sizes[0]]]
        lines.append(f"#   {collective}: median time per call (us), the slowest rank's")
        lines.append("#   " + f"{'bytes':>10}" + "".join(f"{a:>13}" for a in algos) + "  fastest")
        for s in sizes:
            med = {a: median(collective, s, a) for a in algos}
            lines.append(
                "    " + f"{s:>10}" + "".join(f"{med[a] * 1e6:>13.1f}" for a in algos)
                + f"  {min(med, key=med.get)}"
            )  # fmt: skip
    return settings, lines


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    from .launch import LocalGroup
    from .shm import profile

    try:
        worlds = sorted({int(v) for v in str(args.nranks).split(",") if v.strip()})
        if not worlds or min(worlds) < 2:
            raise ValueError("-N: world sizes of 2 or more")
        if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.repeat < 1:
            raise ValueError("need -b <= -e, -f >= 2 and -R >= 1")
    except ValueError as e:
        print(f"# error: {e}", file=sys.stderr)
        return 2
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    here = profile.machine()
    out.write(f"# tpcomm tune: {here['cpu']}, {here['cpus']} CPUs, tpcomm {here['tpcomm']}\n")
    cfg = {"sizes": sizes, "repeat": args.repeat, "target": args.target}
    chosen, measured = {}, {}
    t0 = time.monotonic()
    for w in worlds:
        with LocalGroup(w, pin=not args.no_pin) as group:
            res = group.run(_measure, cfg)[0]
        settings, lines = _settings(sizes, res)
        chosen[w], measured[str(w)] = settings, res
        out.write(f"# world {w}: {profile.encode(settings).replace(',', ', ')}\n")
        out.write("".join(line + "\n" for line in lines))
        out.flush()
    out.write(f"# elapsed {time.monotonic() - t0:.1f}s\n")
    if args.dry_run:
        out.write("# --dry-run: no profile written\n")
        return 0
    path = profile.write(chosen, measured, "tpcomm " + " ".join(sys.argv[1:]), args.output)
    out.write(f"# profile written to {path}: Communicators made here use it "
              "(settings in the environment still win)\n")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpcomm tune", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))

"""all_reduce of float32, bfloat16 and float16 side by side, timed in turns.

Is a 16-bit all_reduce as fast as a float32 one of the same bytes?  Three
`tpcomm perf -d DTYPE` runs one after the other cannot say: on a shared VM the
speed of a whole run moves by 10-30 % (more in a slow mode, docs/PERFORMANCE.md),
more than the difference asked about.  Here the dtypes (and the kernel
variants: the auto choice, and AVX2 forced where the CPU has better) run in
the same two pinned ranks, one block of calls each in turn, the order rotated
every round, so that a change of speed meets all of them alike.

Per block: the slowest rank's time per call.  Per size: the median over the
rounds of each block's time, and the median over the rounds of the ratio
of a dtype's block to the float32 block of the same round and variant.
Every (variant, dtype, size) is checked once against the float64 reference
(``#wrong``).  The same in-place all_reduce as ``tpcomm perf all_reduce``.

What a 16-bit all_reduce costs beyond float32's is its reduce: converting
every value to float32 and back takes more instructions than float32's add.
So each round also times, in the same ranks right after the all_reduce
blocks, the reduce kernel alone on the bytes this rank reduces in a 16-bit
call (one-shot: the whole tensor; two-shot and single copy: its 1/world
share), two sources into the first as the engine calls it, from Python.
``extra``: the 16-bit all_reduce's time over float32's; ``kernel``: the
16-bit kernel's over the float32 kernel's on those bytes (the call from
Python cancels out), what the 16-bit call's reduce costs beyond the same
bytes at float32's speed; both medians of each round's own difference.
``algorithm``: float32's, and the 16-bit floats' where theirs differs (they
have a switch point of their own).  Where both take one algorithm and
``kernel`` is more than 0.15x float32's time, 1.15x needs the arithmetic
hidden behind the reads of the peer's lines; where ``extra`` is above
``kernel`` there, the two add up instead of overlapping.

Run by `make bench`: python benchmarks/dtypes.py [-J FILE] [-b 1K -e 64M -f 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from tpcomm.construction import engine_of
from tpcomm.launch import LocalGroup
from tpcomm.ops import DTYPE_CODES, ReduceOp
from tpcomm.perf.table import data, expected, parse_size
from tpcomm.perf.timing import agree, timed
from tpcomm.shm.engine import isa_variants, kernel_isa, reduce_kernel, select_kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _use(variant: str) -> str:
    """Switch this rank's kernels (every variant gives the same bits, so the
    ranks need not agree); the variant in use and why."""
    if variant == "auto":
        os.environ.pop("TPCOMM_ISA", None)
    else:
        os.environ["TPCOMM_ISA"] = variant
    select_kernels()
    return kernel_isa()


def reduced(comm, size: int) -> int:
    """The bytes one rank's reduce covers in a plain all_reduce of ``size``
    bytes of a 16-bit float as the engine now plans it (one-shot: all of
    them; the others: its 1/world share).  The kernels of every dtype are
    timed on these bytes: float32's may plan another algorithm for the same
    size (its own switch point), and its kernel on other bytes would say
    nothing of what the 16-bit call's arithmetic costs."""
    algo = engine_of(comm).all_reduce_plan(size, torch.bfloat16)[0]
    return size if algo == "one-shot" else -(-size // comm.world_size)


def kernel_call(n: int, d: torch.dtype):
    """The reduce kernel alone on ``n`` values of ``d``, SUM of two sources
    into the first, as a one-shot reduces its own tensor and the peer's slot
    into the tensor (the second source zeros, so that the first keeps its
    values however often it runs), its buffers made once: a call to time."""
    a, b = torch.randn(n).to(d), torch.zeros(n, dtype=d)
    srcs, dst, code = [a.data_ptr(), b.data_ptr()], a.data_ptr(), DTYPE_CODES[d]

    def run(buffers=(a, b)):  # the default keeps the buffers alive
        reduce_kernel(code, ReduceOp.SUM.value, dst, srcs, n)

    return run


def rank(comm, sizes: list, variants: list, rounds: int, seconds: float) -> dict:
    """One rank: per (variant, dtype, size) its time per call in every round,
    the kernel's alone on what such a call reduces, and the values that differ
    from the reference."""
    torch.set_num_threads(1)
    world = comm.world_size
    times, kernel, wrong, algos = {}, {}, {}, {}
    why = {v: _use(v) for v in variants}
    combos = [(v, d) for v in variants for d in DTYPES]
    for size in sizes:
        xs = {}
        kern = {}
        for d in DTYPES:
            count = max(1, size // d.itemsize)
            xs[d] = data(comm.rank, count, d, 0)
            for v in variants:
                _use(v)
                chk = data(comm.rank, count, d, 1)
                comm.all_reduce(chk)
                want = expected(world, count, d, ReduceOp.SUM, 1)
                wrong[(v, NAMES[d], size)] = int((chk != want).sum())
                for _ in range(3):  # warm-up
                    comm.all_reduce(xs[d])
                kern[(v, d)] = kernel_call(max(1, reduced(comm, size) // d.itemsize), d)
        _use(variants[0])
        probe = timed(lambda x=xs[torch.float32]: comm.all_reduce(x), 5)
        per_block = seconds / (rounds * len(combos))
        iters = agree(comm, int(min(20000, max(3, per_block / max(probe, 1e-7)))))
        for r in range(rounds):
            k = r % len(combos)
            for v, d in combos[k:] + combos[:k]:
                _use(v)
                x = xs[d]
                comm.barrier()
                t = timed(lambda x=x: comm.all_reduce(x), iters)
                times.setdefault((v, NAMES[d], size), []).append(t)
            for v, d in combos[k:] + combos[:k]:
                _use(v)
                kern[(v, d)]()
                t = timed(kern[(v, d)], iters)
                kernel.setdefault((v, NAMES[d], size), []).append(t)
        plan = engine_of(comm).all_reduce_plan
        algos[size] = [plan(size, d)[0] for d in (torch.float32, torch.bfloat16)]
    _use("auto")
    return {"times": times, "kernel": kernel, "wrong": wrong, "why": why, "algos": algos}


def summarise(per_rank: list, sizes: list, variants: list) -> dict:
    """Slowest rank per block; medians over the rounds; paired ratios."""
    out = {}
    for v in variants:
        rows = []
        for size in sizes:
            blocks = {
                n: [max(ts) for ts in zip(*(r["times"][(v, n, size)] for r in per_rank))]
                for n in NAMES.values()
            }
            # the kernel: rank 0's (both ranks reduce the same amount at once)
            kern = {n: per_rank[0]["kernel"][(v, n, size)] for n in NAMES.values()}
            a32, a16 = per_rank[0]["algos"][size]
            row = {"size": size, "algorithm": a32 if a16 == a32 else f"{a32} / {a16}"}
            for n, b in blocks.items():
                row[n] = statistics.median(b)
                row[f"{n}_kernel"] = statistics.median(kern[n])
                row[f"{n}_wrong"] = sum(r["wrong"][(v, n, size)] for r in per_rank)
                if n != "float32":
                    f32 = blocks["float32"]
                    row[f"{n}/float32"] = statistics.median(t / f for t, f in zip(b, f32))
                    row[f"{n}_extra"] = statistics.median(t - f for t, f in zip(b, f32))
                    k32 = kern["float32"]
                    row[f"{n}_kernel_extra"] = statistics.median(
                        t - f for t, f in zip(kern[n], k32)
                    )
            rows.append(row)
        out[v] = {"kernels": per_rank[0]["why"][v], "rows": rows}
    return out


def cpu_model() -> str:
    """The CPU as lscpu names it (its /proc/cpuinfo "model name")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def size_arguments(p: argparse.ArgumentParser, least: str, most: str) -> None:
    """-b, -e, -f as tpcomm perf takes them (sizes_of turns them into the sizes)."""
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size(least))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size(most))
    p.add_argument("-f", "--stepfactor", type=int, default=4)


def sizes_of(args: argparse.Namespace) -> list:
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(p, "1K", "64M")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--seconds", type=float, default=1.5, help="per size and variant")
    p.add_argument("-J", "--json", metavar="FILE")
    args = p.parse_args(argv)
    sizes = sizes_of(args)
    have = isa_variants()
    # the auto choice, and AVX2 forced where the CPU has better
    variants = ["auto"] + (["avx2"] if "avx2" in have and "avx512" in have else [])
    with LocalGroup(2, pin=True, timeout=600) as group:
        res = group.run(rank, sizes, variants, args.rounds, args.seconds * len(variants))
    summary = summarise(res, sizes, variants)
    for v, s in summary.items():
        print(
            f"# all_reduce by dtype on {cpu_model()}, 2 ranks pinned, one thread each, "
            f"kernels {s['kernels']}"
            f"{' (TPCOMM_ISA=' + v + ')' if v != 'auto' else ''}"
        )
        print(f"# time per call (us): median over {args.rounds} rounds of blocks in turns")
        print("# extra: over float32's time; kernel: the reduce kernel's alone over float32's")
        print(
            f"# {'size':>8} {'float32':>10} {'bfloat16':>10} {'float16':>10}"
            f" {'bf16/f32':>9} {'f16/f32':>8} {'bf16 extra':>11} {'kernel':>7}"
            f" {'f16 extra':>10} {'kernel':>7} {'#wrong':>7}  algorithm"
        )
        for r in s["rows"]:
            bad = sum(r[f"{n}_wrong"] for n in NAMES.values())
            print(
                f"  {human(r['size']):>8} {r['float32'] * 1e6:>10.2f} {r['bfloat16'] * 1e6:>10.2f}"
                f" {r['float16'] * 1e6:>10.2f} {r['bfloat16/float32']:>8.2f}x"
                f" {r['float16/float32']:>7.2f}x {r['bfloat16_extra'] * 1e6:>11.2f}"
                f" {r['bfloat16_kernel_extra'] * 1e6:>7.2f} {r['float16_extra'] * 1e6:>10.2f}"
                f" {r['float16_kernel_extra'] * 1e6:>7.2f} {bad:>7}  {r['algorithm']}"
            )
    if args.json:
        cmd = (
            f"python benchmarks/dtypes.py -b {args.minbytes} -e {args.maxbytes} "
            f"-f {args.stepfactor} --rounds {args.rounds} --seconds {args.seconds:g}"
        )
        with open(args.json, "w") as f:
            json.dump(
                {"command": cmd, "cpu": cpu_model(), "rounds": args.rounds, "variants": summary}, f
            )
    wrong = sum(
        r[f"{n}_wrong"] for s in summary.values() for r in s["rows"] for n in NAMES.values()
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())

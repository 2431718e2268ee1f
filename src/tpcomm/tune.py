"""``tpcomm tune``: measure on this machine where each all-reduce algorithm
(one-shot, two-shot, single copy; the 16-bit floats' one-shot and two-shot
apart) and the single-copy all_gather win, for the world sizes
given, then, with those switch points, where non-temporal stores into the
slots, a rank's helper threads, going through the slots in chunks of half
the L2 instead of a slot at a time, and reading a comm.empty tensor where it
is instead of copying it pay; write the switch points as a profile
(:mod:`tpcomm.shm.profile`) that every Communicator made here then uses.

Every variant runs on the same ranks and data, in turns (the order turning
each repetition); the table's fastest is the lowest median time.  Two-shot
and single-copy all_reduce and non-temporal stores get a window of sizes
(``window``): of the runs of sizes where the variant is never slower by more
than 3 % (the median of each repetition's own ratio), the one where it is
faster by 3 % or more at the most sizes, from its first win to the run's
end (no end where the run reaches the largest size measured); the 16-bit
floats' two-shot window (bfloat16's and float16's times together,
``_ratios16``) also takes float32's where their own two-shot never
loses by 3 % over both (``with_float32``).  The other
choices get a switch point: the smallest measured size at which the other
variant wins by 3 % and at every larger size is not slower by more than
3 % (-1: never).  The sizes that decide the windows and the all_gather's
switch point (a window's first size, the size past its end) are measured a
second time and the rules run
again on both measurements' repetitions, until every such size has been
measured twice (``_confirm``).  Settings given in the
environment still win over the profile.  A plain all_reduce timed before and
after the measurements says whether the machine kept its speed meanwhile;
where it did not, the world is measured again (``--tries``) and the
steadiest try kept, with a warning if even that one moved (the profile is
written all the same: the ratios are taken within repetitions, which a
short change of speed does not spoil).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

from . import _env
from .construction import engine_of
from .ops import ReduceOp
from .perf.table import parse_size
from .perf.timing import measured
from .shm import profile

__all__ = ["add_arguments", "main", "run", "switch_point", "window", "wins_from", "with_float32"]

ALL_REDUCE = ("one-shot", "two-shot", "single-copy")
ALL_GATHER = ("copy", "single-copy")
# first pass: all_reduce of float32 (its switch points serve the integers
# too), of bfloat16 and float16 (together the window of both 16-bit floats,
# whose reduce costs more, so splitting it between the ranks can pay
# earlier), all_gather
ALGORITHMS = (
    ("all_reduce", ALL_REDUCE, torch.float32),
    ("all_reduce_bf16", ALL_REDUCE[:2], torch.bfloat16),
    ("all_reduce_f16", ALL_REDUCE[:2], torch.float16),
    ("all_gather", ALL_GATHER, torch.float32),
)
# second pass, float32 all_reduce with the first pass's switch points: stores
# into the slots that bypass the caches, and a rank's helper threads (only
# where a rank has more than one)
NT, THREADS = ("cached", "non-temporal"), ("one thread", "threads")
# and an all_reduce a slot at a time against chunk_bytes (half the L2) at a
# time; and, of a comm.empty tensor, the copies against reading the peers'
# tensors where they are
CHUNKS, ZERO_COPY = ("slots", "chunks"), ("copies", "zero-copy")
COPIES = (
    ("nt_stores", NT, torch.float32),
    ("threads", THREADS, torch.float32),
    ("chunks", CHUNKS, torch.float32),
    ("zero_copy", ZERO_COPY, torch.float32),
)
# what a variant changes in the engine (ShmEngine.adjust; all_gather: agree_single_copy)
_OPEN = {"twoshot_max": -1, "twoshot_max16": -1, "cma_ar_max": -1}  # windows with no end
VARIANTS = {
    "one-shot": {"twoshot_min": -1, "twoshot_min16": -1, "cma_ar_min": -1, **_OPEN},
    "two-shot": {"twoshot_min": 0, "twoshot_min16": 0, "cma_ar_min": -1, **_OPEN},
    "single-copy": {"twoshot_min": -1, "twoshot_min16": -1, "cma_ar_min": 0, **_OPEN},
    "cached": {"nt_min": -1, "nt_max": -1, "nt_auto": False},
    "non-temporal": {"nt_min": 0, "nt_max": -1, "nt_auto": False},
    "one thread": {"threads_min": -1},
    "threads": {"threads_min": 0},
    "slots": {"chunk_min": -1},
    "chunks": {"chunk_min": 0},
    "copies": {"zc_min": -1},
    "zero-copy": {"zc_min": 0, "zc_auto": False},  # zero copy itself, never the copies
}
# a first-pass setting -> the engine setting it becomes in the second pass
_APPLIED = {
    "twoshot_min_bytes": "twoshot_min",
    "twoshot_max_bytes": "twoshot_max",
    "twoshot_min_bytes_16bit": "twoshot_min16",
    "twoshot_max_bytes_16bit": "twoshot_max16",
    "cma_allreduce_min_bytes": "cma_ar_min",
    "cma_allreduce_max_bytes": "cma_ar_max",
}


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
    p.add_argument(
        "--threads", type=int, default=0,
        help="threads per rank to measure against one (default: TPCOMM_THREADS' choice; "
        "measured only where it is more than one)",
    )  # fmt: skip
    p.add_argument("-o", "--output", help="the profile (default: TPCOMM_PROFILE or the cache's)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument(
        "--tries", type=int, default=3,
        help="measure a world again, up to this many times in all, while the machine changed "
        "speed during the measurements (the steadiest try is kept; default 3)",
    )  # fmt: skip


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


def window(sizes: list, ratios: list, margin: float = MARGIN) -> tuple[int, int]:
    """Where the other algorithm wins, as a window (lo, hi) of bytes, both
    included: of the runs of sizes where it is never slower by more than the
    margin, the one where it wins (by the margin) at the most sizes (the
    larger sizes' run on a tie); from its first win to the run's last size,
    hi -1 where the run reaches the largest size measured (no end).
    (-1, -1): it never wins.  switch_point's rule, with an end."""
    best, best_wins = (-1, -1), 0
    i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and ratios[j] <= 1 + margin:
            j += 1
        wins = [k for k in range(i, j) if ratios[k] <= 1 - margin]
        if wins and len(wins) >= best_wins:
            best_wins = len(wins)
            best = (sizes[wins[0]], -1 if j == len(sizes) else sizes[j - 1])
        i = j + 1
    return best


def with_float32(
    sizes: list, own: tuple, float32: tuple, ratios: list, margin: float = MARGIN
) -> tuple[int, int]:
    """The 16-bit floats' two-shot window, given float32's: both windows and
    every size between them, where 16-bit two-shot is never slower by more
    than the margin there (``ratios``: its time over one-shot's, per size);
    else its own.  Two-shot halves the reduce, which costs 16-bit more than
    float32 and the copies the same at the same bytes, so where it pays for
    float32 it should pay for them too; their own ratios are the noisier
    (one-shot and two-shot within 3 % of each other over a range of sizes)."""
    if float32[0] < 0 or own == float32:
        return own
    if own[0] < 0:
        lo, hi = float32
    else:
        lo = min(own[0], float32[0])
        hi = -1 if -1 in (own[1], float32[1]) else max(own[1], float32[1])
    inside = [r for s, r in zip(sizes, ratios) if s >= lo and (hi < 0 or s <= hi)]
    return (lo, hi) if all(r <= 1 + margin for r in inside) else own


def wins_from(sizes: list, ratios: list, margin: float = MARGIN) -> int:
    """Where the other algorithm starts to win (-1: never), for one that may
    lose again past a range of sizes (zero copy against the copies): its
    window's first win.  Past it the choice is made as calls run, so where
    the window ends is not kept."""
    return window(sizes, ratios, margin)[0]


def _reference(comm: Any, cfg: dict) -> float:
    """Seconds per call of a plain float32 all_reduce of
    profile.REFERENCE_BYTES with the settings agreed at creation: the median
    of three timings, the slowest rank's."""
    torch.set_num_threads(1)
    x = torch.rand(profile.REFERENCE_BYTES // 4)

    def call() -> None:
        comm.all_reduce(x)

    t = torch.tensor([statistics.median(measured(comm, call, cfg["target"]) for _ in range(3))])
    comm.all_reduce(t, ReduceOp.MAX)
    return float(t.item())


def _use(eng: Any, collective: str, variant: str) -> None:
    if collective == "all_gather":  # collective: every rank switches together
        eng.agree_single_copy(variant == "single-copy", 0)
    else:
        eng.adjust(**VARIANTS[variant])


def _time_variants(comm: Any, eng: Any, cfg: dict, plan: tuple, cma: bool) -> dict:
    """{collective: {size: {variant: [seconds per call, per repetition]}}},
    every variant of a size in turns, the order turning each repetition."""
    out: dict = {}
    w = comm.world_size
    for collective, variants, dtype in plan:
        out[collective] = {}
        variants = [v for v in variants if cma or v != "single-copy"]
        for size in cfg["sizes"]:
            n = max(w, size // dtype.itemsize // w * w)
            x = torch.rand(n if collective != "all_gather" else n // w).to(dtype)
            if collective == "zero_copy":  # in shared memory (collective: every rank)
                x = comm.empty(x.shape, dtype).copy_(x)
            fn = comm.all_gather if collective == "all_gather" else comm.all_reduce

            def call(fn=fn, x=x) -> None:
                fn(x)

            times: dict = {v: [] for v in variants}
            for rep in range(cfg["repeat"]):
                turn = rep % len(variants)
                for variant in variants[turn:] + variants[:turn]:
                    _use(eng, collective, variant)
                    times[variant].append(measured(comm, call, cfg["target"]))
            out[collective][size] = _worst(comm, times)
    return out


def _measure(comm: Any, cfg: dict) -> dict:
    """One rank, the first pass (the algorithms): their times, and whether
    single copy could run here."""
    torch.set_num_threads(1)
    eng = engine_of(comm)
    # single copy only where this machine lets the ranks read each other
    cma = eng.agree_single_copy(True, 0)[1]
    plan = tuple(a for a in ALGORITHMS if cfg.get("only") in (None, a[0]))
    try:
        return {"single_copy_possible": cma, **_time_variants(comm, eng, cfg, plan, cma)}
    finally:
        eng.restore()


def _measure_copies(comm: Any, cfg: dict, chosen: dict) -> dict:
    """One rank, the second pass: with the first pass's switch points,
    non-temporal stores against cached ones, this rank's threads against one
    (where it has more than one), a slot at a time against chunks (past one
    chunk), and the zero-copy all_reduce of comm.empty tensors against
    copying them."""
    torch.set_num_threads(1)
    eng = engine_of(comm)
    threads = cfg["threads"] or eng.settings.threads
    ar_min = chosen.get("cma_allreduce_min_bytes", -1)
    cma = eng.agree_single_copy(ar_min >= 0, 0)[1]
    try:
        eng.adjust(**{_APPLIED[k]: v for k, v in chosen.items() if k in _APPLIED})
        res = _time_variants(comm, eng, cfg, COPIES[:1], cma)
        if cfg.get("only") == "nt_stores":  # measured again (_confirm)
            return res
        # with the stores just chosen (every rank has the same times)
        stores = _copy_settings(cfg["sizes"], res)
        nt, nt_max = stores["nt_min_bytes"], stores["nt_max_bytes"]
        if threads > 1:
            eng.adjust(nt_min=nt, nt_max=nt_max, threads=threads)
            res.update(_time_variants(comm, eng, cfg, COPIES[1:2], cma))
        # the stores and threads as they will run from here (the stores chosen as
        # they run where the settings say so: fixed, the smaller chunks would
        # fall below nt_min and lose by the stores alone)
        s = eng.settings
        eng.adjust(
            nt_min=nt, nt_max=nt_max, nt_auto=s.nt_auto, threads=s.threads,
            threads_min=s.threads_min,
        )  # fmt: skip
        chunk = eng.current.chunk_bytes
        big = {**cfg, "sizes": [n for n in cfg["sizes"] if n > chunk]}
        if chunk < eng.slot_bytes and big["sizes"]:  # rank 0's chunk: what a profile gives
            res.update(_time_variants(comm, eng, big, COPIES[2:3], cma))
        # zero copy against the copies with the chunks as they will run
        if "chunks" in res:
            points = _copy_settings(cfg["sizes"], {**res, "chunk_bytes": chunk})
            eng.adjust(chunk_min=points["chunk_min_bytes"])
        res.update(_time_variants(comm, eng, cfg, COPIES[3:], cma))
    finally:
        eng.restore()
    return {"threads_per_rank": threads, "chunk_bytes": chunk, **res}


def _worst(comm: Any, times: dict) -> dict:
    """Each repetition's time as the slowest rank saw it."""
    out = {}
    for algo, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float32)
        comm.all_reduce(t, ReduceOp.MAX)
        out[algo] = t.tolist()
    return out


def _ratios(sizes: list, res: dict, collective: str, variant: str, *base: str) -> list:
    """Per size, the median over the repetitions of each one's own ratio:
    variant's time over the fastest of base's."""
    out = []
    for s in sizes:
        t = res[collective][s]
        reps = range(len(t[variant]))
        out.append(statistics.median(t[variant][r] / min(t[b][r] for b in base) for r in reps))
    return out


def _ratios16(sizes: list, res: dict) -> list:
    """The 16-bit floats' two-shot over one-shot, per size: the median over
    the repetitions of bfloat16's and float16's two-shot times summed over
    their one-shot times summed.  One window serves both; where their kernels
    differ (AMD Zen 4: bfloat16 by AVX512_BF16, float16 by 256-bit F16C at
    3/4 of its speed) the one that gains or loses more time decides."""
    out = []
    for s in sizes:
        b, f = res["all_reduce_bf16"][s], res["all_reduce_f16"][s]
        pairs = zip(b["two-shot"], f["two-shot"], b["one-shot"], f["one-shot"])
        out.append(statistics.median((b2 + f2) / (b1 + f1) for b2, f2, b1, f1 in pairs))
    return out


def _settings(sizes: list, res: dict) -> dict:
    """The algorithms' switch points from one world's first pass."""

    def point(collective: str, variant: str, *base: str) -> int:
        return switch_point(sizes, _ratios(sizes, res, collective, variant, *base))

    def span(collective: str, variant: str, *base: str) -> tuple:
        return window(sizes, _ratios(sizes, res, collective, variant, *base))

    settings: dict = {}
    two = span("all_reduce", "two-shot", "one-shot")
    settings["twoshot_min_bytes"], settings["twoshot_max_bytes"] = two
    ratios16 = _ratios16(sizes, res)
    two16 = with_float32(sizes, window(sizes, ratios16), two, ratios16)
    settings["twoshot_min_bytes_16bit"], settings["twoshot_max_bytes_16bit"] = two16
    if res["single_copy_possible"]:
        one = span("all_reduce", "single-copy", "one-shot", "two-shot")
        settings["cma_allreduce_min_bytes"], settings["cma_allreduce_max_bytes"] = one
        settings["cma_min_bytes"] = point("all_gather", "single-copy", "copy")
    return settings


def _copy_settings(sizes: list, res: dict) -> dict:
    """The second pass's settings: the switch points of non-temporal stores,
    helper threads and chunks (and rank 0's chunk), where zero copy starts."""
    nt = window(sizes, _ratios(sizes, res, "nt_stores", *NT[::-1]))
    out = {"nt_min_bytes": nt[0], "nt_max_bytes": nt[1]}
    if "threads" in res:
        out["threads_min_bytes"] = switch_point(
            sizes, _ratios(sizes, res, "threads", *THREADS[::-1])
        )
    if "zero_copy" in res:
        # only where zero copy starts to win: from there rank 0 chooses it or
        # the copies as calls run (zc_auto), state by state of the machine, so
        # a measurement made in one state neither caps it nor turns it off
        # (with no win here the default stands)
        lo = wins_from(sizes, _ratios(sizes, res, "zero_copy", *ZERO_COPY[::-1]))
        if lo >= 0:
            out["zero_copy_min_bytes"] = lo
    if "chunks" in res:
        big = [s for s in sizes if s in res["chunks"]]
        out["chunk_min_bytes"] = switch_point(big, _ratios(big, res, "chunks", *CHUNKS[::-1]))
        if out["chunk_min_bytes"] >= 0:
            out["chunk_bytes"] = res["chunk_bytes"]
    return out


def _window_edges(sizes: list, span: tuple) -> list:
    """The sizes that decide a window: its first size (a win, or for the
    16-bit floats one float32's window lends them), and the size past its end
    (a loss; none where it has no end)."""
    lo, hi = span
    if lo < 0:
        return []
    after = [s for s in sizes if s > hi] if hi >= 0 else []
    return [lo] + after[:1]


# what decides each window (its settings, from, up to) or switch point: the
# collectives measured again at its edges, the variant and what it is timed against
DECIDED_BY = (
    (("twoshot_min_bytes", "twoshot_max_bytes"), ("all_reduce",), "two-shot", ("one-shot",)),
    (
        ("twoshot_min_bytes_16bit", "twoshot_max_bytes_16bit"),
        ("all_reduce_bf16", "all_reduce_f16"), "two-shot", ("one-shot",),
    ),
    (
        ("cma_allreduce_min_bytes", "cma_allreduce_max_bytes"),
        ("all_reduce",), "single-copy", ("one-shot", "two-shot"),
    ),
    (("cma_min_bytes",), ("all_gather",), "single-copy", ("copy",)),
    (("nt_min_bytes", "nt_max_bytes"), ("nt_stores",), "non-temporal", ("cached",)),
)  # fmt: skip


def _edges_of(sizes: list, settings: dict) -> list:
    """(collective, size, variant, base...) for every edge of the windows
    and switch points in ``settings``."""
    out = []
    for keys, collectives, variant, base in DECIDED_BY:
        if keys[0] not in settings:
            continue
        got = [settings[k] for k in keys]
        at = _window_edges(sizes, tuple(got)) if len(got) == 2 else [s for s in got if s >= 0]
        out.extend((c, s, variant, *base) for s in at for c in collectives)
    return out


def _edges(sizes: list, res: dict) -> list:
    """The first pass's deciding measurements: the edges of what it writes."""
    return _edges_of(sizes, _settings(sizes, res))


def _copy_edges(sizes: list, res: dict) -> list:
    """The second pass's: the edges of the stores' window."""
    stores = _copy_settings(sizes, res)
    return _edges_of(sizes, {k: stores[k] for k in ("nt_min_bytes", "nt_max_bytes")})


def _confirm(
    measure: Callable[[dict], dict],
    cfg: dict,
    res: dict,
    edges: Callable[[list, dict], list],
    out: Any,
) -> None:
    """Measure every edge that ``edges`` gives (of a window or switch point)
    once more before it is written: a size where one algorithm wins or loses
    decides the choice of a whole range of sizes, so it needs two
    measurements that agree, not one (on a shared machine one measurement's
    7 % win was the next one's 10-15 % loss, docs/DECISIONS.md).  The new
    repetitions join the old ones in ``res`` and the rules run again on all
    of them, until every edge they give has been measured twice: what is
    written stays the rule applied to what was measured.  ``measure(cfg)``:
    one pass's results for cfg["only"] at cfg["sizes"]."""
    sizes, done = cfg["sizes"], set()
    while True:
        todo = [e for e in edges(sizes, res) if e[:2] not in done]
        if not todo:
            return
        collective, size, variant, *base = todo[0]
        done.add((collective, size))
        was = _ratios([size], res, collective, variant, *base)[0]
        more = measure({**cfg, "sizes": [size], "only": collective})[collective][size]
        for v, ts in more.items():
            res[collective][size][v] = res[collective][size][v] + ts
        now = _ratios([size], res, collective, variant, *base)[0]
        n = len(res[collective][size][variant])
        out.write(f"#   measured again, the edge of a choice: {collective} {size} bytes, "
                  f"{variant} / {' or '.join(base)} {was:.2f} -> {now:.2f} "
                  f"({n} repetitions)\n")  # fmt: skip


def _table(sizes: list, res: dict, plan: tuple) -> list:
    """The lines that show what was measured, a table per collective."""
    lines = []
    for collective, variants, _ in plan:
        if collective not in res:
            continue
        measured = [s for s in sizes if s in res[collective]]  # chunks: past one chunk
        if not measured:
            continue
        variants = [v for v in variants if v in res[collective][measured[0]]]
        lines.append(f"#   {collective}: median time per call (us), the slowest rank's")
        head = "".join(f"{v:>13}" for v in variants)
        lines.append("#   " + f"{'bytes':>10}" + head + "  fastest")
        for s in measured:
            med = {v: statistics.median(res[collective][s][v]) for v in variants}
            lines.append(
                "    " + f"{s:>10}" + "".join(f"{med[v] * 1e6:>13.1f}" for v in variants)
                + f"  {min(med, key=med.get)}"
            )  # fmt: skip
    return lines


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    from .launch import LocalGroup

    try:
        worlds = sorted({int(v) for v in str(args.nranks).split(",") if v.strip()})
        if not worlds or min(worlds) < 2:
            raise ValueError("-N: world sizes of 2 or more")
        if args.minbytes > args.maxbytes or args.stepfactor < 2 or args.repeat < 1:
            raise ValueError("need -b <= -e, -f >= 2 and -R >= 1")
        if args.tries < 1:
            raise ValueError("--tries: 1 or more")
        if not 0 <= args.threads <= _env.MAX_THREADS:
            raise ValueError(f"--threads: 1 to {_env.MAX_THREADS} (0: TPCOMM_THREADS' choice)")
    except ValueError as e:
        print(f"# error: {e}", file=sys.stderr)
        return 2
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= args.stepfactor
    here = profile.machine()
    out.write(f"# tpcomm tune: {here['cpu']}, {here['cpus']} CPUs, tpcomm {here['tpcomm']}\n")
    cfg = {"sizes": sizes, "repeat": args.repeat, "target": args.target, "threads": args.threads}
    chosen, results = {}, {}
    t0 = time.monotonic()
    for w in worlds:
        tries = []  # (how far the speed moved, before, after, res, settings, copies)
        while len(tries) < args.tries and not (tries and tries[-1][0] <= profile.STEADY):
            if tries:
                _, b, a = tries[-1][:3]
                out.write(f"# world {w}: a plain {profile.REFERENCE_BYTES >> 20} MiB all_reduce "
                          f"took {b * 1e6:.1f} us before and {a * 1e6:.1f} us after; measuring "
                          f"again (try {len(tries) + 1} of {args.tries})\n")  # fmt: skip
                out.flush()
            with LocalGroup(w, pin=not args.no_pin) as group:
                before = group.run(_reference, cfg)[0]
                res = group.run(_measure, cfg)[0]
                _confirm(lambda c: group.run(_measure, c)[0], cfg, res, _edges, out)
                settings = _settings(sizes, res)
                copies = group.run(_measure_copies, cfg, settings)[0]
                _confirm(
                    lambda c, s=settings: group.run(_measure_copies, c, s)[0], cfg, copies,
                    _copy_edges, out,
                )  # fmt: skip
                after = group.run(_reference, cfg)[0]
            tries.append((profile.speed_moved(before, after), before, after, res, settings, copies))
        _, before, after, res, settings, copies = min(tries, key=lambda t: t[0])
        settings.update(_copy_settings(sizes, copies))
        res.update(copies, reference_s=[before, after])
        chosen[w], results[str(w)] = settings, res
        out.write(f"# world {w}: {profile.encode(settings).replace(',', ', ')}\n")
        warning = profile.steadiness(before, after)
        out.write(
            f"#   a plain {profile.REFERENCE_BYTES >> 20} MiB all_reduce: {before * 1e6:.1f} us "
            f"before the measurements, {after * 1e6:.1f} us after\n"
        )
        if warning:
            out.write(f"# {warning}\n")
            print(f"tpcomm tune: world {w}: {warning}", file=sys.stderr)
        lines = _table(sizes, res, ALGORITHMS + COPIES)
        if "threads" not in res:
            lines.append(f"#   threads: not measured ({copies['threads_per_rank']} per rank; "
                         "--threads N measures N)")  # fmt: skip
        out.write("".join(line + "\n" for line in lines))
        out.flush()
    out.write(f"# elapsed {time.monotonic() - t0:.1f}s\n")
    if args.dry_run:
        out.write("# --dry-run: no profile written\n")
        return 0
    path = profile.write(chosen, results, "tpcomm " + " ".join(sys.argv[1:]), args.output)
    out.write(f"# profile written to {path}: Communicators made here use it "
              "(settings in the environment still win)\n")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpcomm tune", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))

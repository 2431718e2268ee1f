"""Plain stores, non-temporal stores and the running choice between them, in
turns, for the all_reduce sizes whose copies choose (4 KiB and up, one-shot
and two-shot as the switch point says), or for another collective's copies,
which store as an all_reduce chunk of their size chose (`--collective`).

Which store into a slot costs less changes with the machine's state, by
seconds on a shared VM (benchmarks/oneshot.c), so three runs one after the
other compare states, not stores.  Here three communicators of the same two
pinned ranks (one fixed to plain stores, one to non-temporal ones, one
choosing as it runs: the default) take blocks of calls in turns, the order
turning every round, so that every state meets all three (the same
algorithm each: the default switch point, or the profile's).  Per block: the
slower rank's time per call.  Per size: the median block of each, the median
over the rounds of each round's ratio to the faster fixed kind ("auto/best"),
and how many rounds each fixed kind won.  A broadcast or all_gather block
(each rank's copy into a slot: `size` bytes) follows an untimed block of
all_reduces of as many bytes on the same communicator, as an application's
all_reduces keep the choice current.

Run by `make bench`: python benchmarks/stores.py [-b 4K -e 4M -f 4]
[--collective broadcast]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from dtypes import cpu_model, human, size_arguments, sizes_of  # beside this script

from tpcomm.construction import engine_of
from tpcomm.launch import LocalGroup
from tpcomm.perf.timing import agree, timed

KINDS = ("plain", "non-temporal", "auto")


def call_of(comm, collective: str, x, out):
    """One call of the collective under test on comm: size bytes in a slot."""
    if collective == "broadcast":
        return lambda: comm.broadcast(x, 0)
    if collective == "all_gather":
        return lambda: comm.all_gather_into_tensor(out, x)
    return lambda: comm.all_reduce(x)


def rank(comm, sizes: list, rounds: int, seconds: float, collective: str) -> dict:
    torch.set_num_threads(1)
    comms = {k: comm.dup() for k in KINDS}
    for k, fixed in (("plain", -1), ("non-temporal", 0)):  # fixed stores
        engine_of(comms[k]).adjust(nt_min=fixed, nt_auto=False)
    times: dict = {}
    try:
        for size in sizes:
            x = torch.rand(size // 4)
            out = torch.empty(comm.world_size * x.numel())
            for c in comms.values():  # warm-up: the running choice learns
                for _ in range(2000):
                    c.all_reduce(x.fill_(1.0))
            calls = {k: call_of(c, collective, x, out) for k, c in comms.items()}
            probe = timed(calls["plain"], 20)
            iters = agree(comm, max(50, int(seconds / rounds / len(KINDS) / max(probe, 1e-7))))
            for r in range(rounds):
                k = r % len(KINDS)
                for kind in KINDS[k:] + KINDS[:k]:
                    c = comms[kind]
                    if collective != "all_reduce":  # the application's all_reduces
                        timed(lambda c=c, x=x: c.all_reduce(x), iters)
                    c.barrier()
                    times.setdefault((kind, size), []).append(timed(calls[kind], iters))
        return {"times": times, "stores": engine_of(comms["auto"]).stores()}
    finally:
        for c in comms.values():
            c.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(p, "4K", "4M")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seconds", type=float, default=3.0, help="per size")
    p.add_argument("--collective", choices=("all_reduce", "broadcast", "all_gather"),
                   default="all_reduce")  # fmt: skip
    args = p.parse_args(argv)
    sizes = sizes_of(args)
    with LocalGroup(2) as g:
        res = g.run(
            rank,
            sizes,
            args.rounds,
            args.seconds,
            args.collective,
            timeout=60 + 8 * args.seconds * len(sizes),
        )
    print(f"# {args.collective} of float32 by store kind on {cpu_model()}, 2 ranks pinned; "
          f"{args.rounds} rounds of blocks in turns")  # fmt: skip
    print(
        f"# {'size':>8} {'plain':>9} {'non-temp':>9} {'auto':>9}  auto/best  "
        "rounds won by plain / non-temporal"
    )
    for size in sizes:
        b = {k: [max(t) for t in zip(*(r["times"][(k, size)] for r in res))] for k in KINDS}
        ratio = statistics.median(
            a / min(pl, nt) for a, pl, nt in zip(b["auto"], b["plain"], b["non-temporal"])
        )
        won = sum(pl < nt for pl, nt in zip(b["plain"], b["non-temporal"]))
        med = {k: statistics.median(v) * 1e6 for k, v in b.items()}
        print(
            f"  {human(size):>8} {med['plain']:>9.2f} {med['non-temporal']:>9.2f} "
            f"{med['auto']:>9.2f}  {ratio:>9.2f}  {won} / {args.rounds - won}"
        )
    st = res[0]["stores"]
    n = st["sizes"]
    print(f"# rank 0's choice at the end, by size from 4 KiB (1: non-temporal): one-shot "
          f"{st['nt'][:n]}, two-shot {st['nt'][n:]}; {st['switches']} changes of mind, "
          f"{st['kept']} of {st['probations']} probations kept")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The record of a Communicator's rounds and waits: where a call's time goes.

``Communicator.stats()`` returns it at any time.  ``TPCOMM_STATS`` has every
Communicator of the process report it when it closes (or when the process
exits), the way ``NCCL_DEBUG`` tells NCCL users what NCCL did:

* ``TPCOMM_STATS=1``: a few lines on stderr per Communicator;
* ``TPCOMM_STATS=/some/dir``: one JSON file per Communicator in that
  directory (``tpcomm-stats-<pid>-<rank>-<n>.json``), which
  ``tpcomm doctor --stats /some/dir`` prints.

With the record on, every publish also carries a time stamp, so that a
waiter can tell how late it saw its peer's publish ("lateness": from the
moment the last peer published a round to the moment this rank saw it, by
how its wait ended: spinning, yielding or asleep on the futex).  The counters
themselves always run: a few increments per wait.

The record's fields (the C core's, ``_native/wait.c``):

========== ==============================================================
rounds     collective rounds by kind (an all_reduce of one slot: 1 round)
instant    waits whose peer had published already
waits      waits that had to wait; ``ended``: how (spin, yield, sleep)
wait_ns    the time those waits took, in all
yields     sched_yield calls; ``sleeps``: futex sleeps (and naps)
crowded    times the waits stopped yielding: a yield lost the core for
           more than 200 us to another process, so they sleep instead;
           ``yield_max_us``: the longest yield
late_*     lateness (ns) by how the wait ended: count, sum, max; and a
           histogram, bucket b counting lateness under 2^b us
populated  outputs a collective found without pages (a tensor just
           made) and mapped in one call before writing them
           (``populated_bytes``: their bytes; ``_native/pages.c``)
========== ==============================================================
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import weakref
from typing import Any

from . import _env
from .shm.engine import KIND_NAMES

__all__ = ["describe", "start", "finish", "read_dir"]

ENDED = ("spin", "yield", "sleep")

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_count = itertools.count()


def shape(raw: dict, rank: int, world: int) -> dict:
    """The core's record as a user reads it (stats())."""
    rounds = {KIND_NAMES.get(k, "other"): n for k, n in enumerate(raw["rounds"]) if n}
    late = {
        how: {
            "n": raw["late_n"][i],
            "mean_us": raw["late_ns"][i] / raw["late_n"][i] / 1e3 if raw["late_n"][i] else 0.0,
            "max_us": raw["late_max"][i] / 1e3,
        }
        for i, how in enumerate(ENDED)
    }
    return {
        "rank": rank,
        "world_size": world,
        "rounds": rounds,
        "instant": raw["instant"],
        "waits": raw["waits"],
        "ended": dict(zip(ENDED, raw["ended"])),
        "wait_us": raw["wait_ns"] / 1e3,
        "yields": raw["yields"],
        "sleeps": raw["sleeps"],
        "crowded": raw["crowded"],
        "yield_max_us": raw["lost_max"] / 1e3,
        "stamped": bool(raw["stamp"]),
        "late": late,
        "late_hist_us": {f"<{1 << b}" if b < 15 else f">={1 << 14}": n
                         for b, n in enumerate(raw["late_hist"]) if n},
        "populated": raw["populated"],
        "populated_bytes": raw["populated_bytes"],
    }  # fmt: skip


def describe(rec: dict, name: str = "") -> str:
    """A few lines a person reads (what TPCOMM_STATS=1 prints)."""
    rounds = sum(rec["rounds"].values())
    total = rec["instant"] + rec["waits"]
    head = f"tpcomm stats{' ' + name if name else ''}: rank {rec['rank']}/{rec['world_size']}"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(rec["rounds"].items(), key=lambda x: -x[1]))
    lines = [f"{head}: {rounds} rounds ({kinds or 'none'})"]
    mean = rec["wait_us"] / rec["waits"] if rec["waits"] else 0.0
    e = rec["ended"]
    lines.append(
        f"  waits {total}: {rec['instant']} found the peer there, {rec['waits']} waited "
        f"{rec['wait_us'] / 1e3:.1f} ms in all (mean {mean:.1f} us), ended spinning "
        f"{e['spin']}, yielding {e['yield']}, asleep {e['sleep']}"
    )
    lines.append(
        f"  yields {rec['yields']} (the longest {rec['yield_max_us']:.0f} us), futex sleeps "
        f"{rec['sleeps']}, crowded {rec['crowded']} (a yield lost the core for > 200 us: "
        f"sleeps instead of yields for 1 s)"
    )
    if rec.get("populated"):
        lines.append(
            f"  outputs given their pages first: {rec['populated']} "
            f"({rec['populated_bytes'] / 2**20:.1f} MiB)"
        )
    if rec["stamped"]:
        parts = [
            f"{how} {v['n']} x {v['mean_us']:.1f} us (max {v['max_us']:.0f})"
            for how, v in rec["late"].items()
            if v["n"]
        ]
        lines.append(
            "  late to a peer's publish, by how the wait ended: " + (", ".join(parts) or "-")
        )
    return "\n".join(lines)


def start(comm: Any, path: Any) -> None:
    """A new Communicator (``path``: the one whose record it reports,
    ``paths.Path.record``): where TPCOMM_STATS is set, stamp its publishes and
    report it at close (or at exit)."""
    if _env.stats() is None or path.record(stamp=True) is None:
        return
    comm._stats_id = next(_count)
    _live.add(comm)


def finish(comm: Any, rec: Any = None) -> None:
    """A Communicator closes (``rec``: its record, read there) or the process
    exits: report the record where TPCOMM_STATS says."""
    if comm not in _live:
        return
    _live.discard(comm)
    to = _env.stats()
    if to is None:
        return
    if rec is None:
        try:
            rec = comm.stats()
        except Exception:
            return
    if to == "stderr":
        sys.stderr.write(describe(rec) + "\n")
        sys.stderr.flush()
        return
    os.makedirs(to, exist_ok=True)
    path = os.path.join(to, f"tpcomm-stats-{os.getpid()}-{rec['rank']}-{comm._stats_id}.json")
    with open(path, "w") as f:
        json.dump(dict(rec, pid=os.getpid()), f)


def read_dir(path: str) -> list:
    """The records a TPCOMM_STATS directory holds, oldest first."""
    out = []
    for name in sorted(os.listdir(path)):
        if name.startswith("tpcomm-stats-") and name.endswith(".json"):
            with open(os.path.join(path, name)) as f:
                out.append((name, json.load(f)))
    return out


@atexit.register
def _at_exit() -> None:
    for comm in list(_live):
        finish(comm)

"""Calls that differ between ranks: a ValueError on every rank at once, and the
communicator stays usable, for the calls that are not plain collectives too.

Guards: ``comm.empty()`` on one rank while another calls ``all_reduce`` (both
got a ValueError, then every later call raised PeerFailedError though every
rank lived); ``dup()`` on one rank while another calls ``barrier()`` (dup
waited the whole timeout; the other rank erred only at its next call).
"""

from __future__ import annotations

import time

import torch

from tpcomm.launch import LocalGroup

from ._helpers import SLACK_S


def empty_vs_all_reduce(comm):
    t0 = time.monotonic()
    try:
        if comm.rank == 0:
            comm.empty((64,), torch.float32)
        else:
            comm.all_reduce(torch.ones(64))
        first = "no error"
    except ValueError as e:
        first = str(e)
    took = time.monotonic() - t0
    x = torch.full((8,), float(comm.rank + 1))
    comm.all_reduce(x)  # still usable
    y = comm.empty((16,), torch.float32)  # empty() too
    y.fill_(2.0)
    comm.all_reduce(y)
    return first, took, x.tolist(), y[0].item()


def test_empty_mismatch_leaves_the_communicator_usable():
    with LocalGroup(2, timeout=30) as g:
        res = g.run(empty_vs_all_reduce, timeout=60)
    for first, took, x, y in res:
        assert "mismatched collective" in first and "empty" in first and "all_reduce" in first
        assert took < SLACK_S
        assert x == [3.0] * 8 and y == 4.0


def dup_vs_barrier(comm):
    t0 = time.monotonic()
    try:
        if comm.rank == 0:
            comm.dup()
        else:
            comm.barrier()
        first = "no error"
    except ValueError as e:
        first = str(e)
    took = time.monotonic() - t0
    comm.barrier()
    other = comm.dup()  # dup itself still works, on every rank
    x = torch.ones(4)
    other.all_reduce(x)
    other.close()
    return first, took, x.tolist()


def test_dup_takes_part_in_mismatch_detection():
    with LocalGroup(2, timeout=30) as g:
        res = g.run(dup_vs_barrier, timeout=60)
    for first, took, x in res:
        assert "mismatched collective" in first and "dup()" in first and "barrier()" in first
        assert took < SLACK_S
        assert x == [2.0] * 4

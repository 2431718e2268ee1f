"""Deaths during set-up: a peer that dies while a communicator forms, while it
is dup()ed, or between closing one and making the next, is a PeerFailedError
on the survivors within a poll, not a CommTimeoutError at the end of the
rendezvous timeout; a job killed during set-up leaves a file that the next
creation on the host removes.

Each case runs ranks of a from_env job (timeout 60 s); one rank kills itself
(SIGKILL) at a chosen point; the others report what they raised and when.
"""

from __future__ import annotations

import os
import time

import pytest

from tpcomm.shm import segment

from ._helpers import script_ranks

SCRIPT = r"""
import os, signal, time, torch, tpcomm
from tpcomm import bootstrap, communicator
from tpcomm.shm import engine, segment

rank, victim, point = int(os.environ["RANK"]), int(os.environ["VICTIM"]), os.environ["POINT"]


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


if rank == victim:
    if point == "attach":  # a peer dies right before it maps rank 0's segment
        engine.ShmEngine.map = die
    elif point == "segment":  # rank 0 dies with its segment made, not yet published
        real = segment.create
        segment.create = lambda *a, **k: (real(*a, **k), die())
    elif point == "dup":  # dies as the dup()'s set-up begins (after its round)
        calls = []
        real_publish = bootstrap.Watch.publish

        def publish(self):
            calls.append(1)
            if len(calls) == 2:
                die()
            real_publish(self)

        bootstrap.Watch.publish = publish
    elif point == "close":  # dies while closing, before the next communicator
        communicator.Communicator.close = die

t0 = time.monotonic()
try:
    for i in range(3):
        comm = tpcomm.Communicator.from_env(timeout=60)
        x = torch.ones(4)
        comm.all_reduce(x)
        if point == "dup":
            comm.dup().close()
        comm.close()
    print("no error", flush=True)
except tpcomm.PeerFailedError as e:
    print("PeerFailedError", e.rank, round(time.monotonic() - t0, 2), e, flush=True)
except Exception as e:
    print(type(e).__name__, round(time.monotonic() - t0, 2), e, flush=True)
"""


def _job(world: int, victim: int, point: str, timeout: float = 120) -> list:
    """(rank, exit status, first word of its report, the report) of every rank."""
    envs = [{"VICTIM": str(victim), "POINT": point}] * world
    ranks = script_ranks(SCRIPT, envs, timeout)
    return [(r, code, out) for r, (code, out) in enumerate(ranks)]


def _survivors_saw_the_death(results: list, victim: int) -> None:
    for r, code, out in results:
        if r == victim:
            assert code == -9, (r, code, out)
            continue
        words = out.split()
        assert words[:2] == ["PeerFailedError", str(victim)], (r, out)
        # the rendezvous timeout is 60 s: the death was seen within a poll
        assert float(words[2]) < 10, (r, out)


@pytest.mark.parametrize("point", ["attach", "dup", "close"])
def test_a_peer_that_dies_during_set_up_is_a_peer_failure(point):
    _survivors_saw_the_death(_job(3, 1, point), 1)


def test_rank_0_dying_with_its_segment_made_is_a_peer_failure_and_leaves_nothing(shm_dir):
    """Rank 0 (which also hosts the set-up store) dies between creating the
    segment and publishing it: the others raise PeerFailedError(0) at once; the
    file it left (a job killed during set-up) is stale, and the next creation
    of a segment on this host removes it."""
    _survivors_saw_the_death(_job(2, 0, "segment"), 0)
    left = [p for p, _, _ in segment.stale(shm_dir, min_age_s=0)]
    assert len(left) == 1 and "-env-" in left[0], left
    old = time.time() - 2 * segment.STALE_AGE_S
    os.utime(left[0], (old, old))
    path, fd = segment.create(2, 4096, "test")
    os.close(fd)
    segment.unlink_quietly(path)
    assert not os.path.exists(left[0])


def test_a_live_file_is_never_swept(shm_dir):
    """A file being set up (its creator holds its lock) or a segment whose ranks
    live is left alone by the sweep, however old."""
    path, fd = segment.create(2, 4096, "test")
    try:
        old = time.time() - 10 * segment.STALE_AGE_S
        os.utime(path, (old, old))
        assert segment.stale(shm_dir) == []
        other, ofd = segment.create(2, 4096, "test")  # sweeps
        os.close(ofd)
        segment.unlink_quietly(other)
        assert os.path.exists(path)
    finally:
        os.close(fd)
    # its creator gone (closed the fd) and old: stale
    assert [p for p, _, _ in segment.stale(shm_dir)] == [path]
    segment.unlink_quietly(path)

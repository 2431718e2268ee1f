"""README's error table, row by row: each row's cases raise what the row says.

Guards: the table a user reads is what tpcomm does.  Rows whose cases need a
dying or stalled process have their full tests elsewhere, named in each
test's docstring; each gets a short case of its own here.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _testing
from tpcomm.launch import LocalGroup
from tpcomm.shm import segment

from ._helpers import SLACK_S


def _raised(call) -> str:
    """The type name of what call() raised, and its message; "no error"."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _type_errors(comm):
    ints = torch.ones(4, dtype=torch.int32)
    return [
        _raised(lambda: comm.all_reduce([1.0, 2.0])),
        _raised(lambda: comm.all_reduce(ints, tpcomm.ReduceOp.AVG)),
        _raised(lambda: comm.all_reduce(torch.ones(4), "sum")),
        # a dtype or op the engine lacks is no error: torch.distributed does it
        comm.all_reduce(torch.ones(4, dtype=torch.float64)).tolist(),
        comm.all_reduce(torch.full((2,), 2.0), dist.ReduceOp.PRODUCT).tolist(),
    ]


def test_row_type_errors(pools):
    """Not a tensor, AVG on integers, an op that is not a reduce op: TypeError
    naming the function; an unsupported dtype or op is served by torch.distributed."""
    for res in pools.run(2, _type_errors):
        assert res[0].startswith("TypeError: all_reduce: tensor must be a torch.Tensor"), res
        assert res[1].startswith("TypeError: all_reduce: ReduceOp.AVG needs a floating"), res
        assert res[2].startswith("TypeError: all_reduce:"), res
        assert res[3] == [2.0] * 4 and res[4] == [4.0, 4.0], res


def _value_errors(comm):
    r = comm.rank
    out = [
        _raised(lambda: comm.all_gather(torch.ones(3, device="meta"))),
        _raised(lambda: comm.all_reduce(torch.ones(1).expand(4))),
    ]
    if r == 0:
        comm.send([torch.ones(4)], dst=1)
    else:
        out.append(_raised(lambda: comm.recv(0, out=[torch.empty(8)[::2]])))
        comm.recv(0)  # the message is still there: nothing was received
    # ranks that disagree on the element count: a ValueError on every rank
    out.append(_raised(lambda: comm.all_reduce(torch.ones(4 + r))))
    out.append(comm.all_reduce(torch.ones(2)).tolist())  # still usable
    return out


def test_row_value_errors(pools):
    """A meta tensor, an output whose elements share memory, a recv(out=) that
    is not contiguous, ranks calling with different counts: ValueError before
    anything is touched (a mismatch on every rank, naming both calls)."""
    r0, r1 = pools.run(2, _value_errors)
    for res in (r0, r1):
        assert res[0].startswith("ValueError: all_gather: tensor must be a CPU tensor"), res
        assert res[1].startswith("ValueError: all_reduce:") and "overlap" in res[1], res
        assert res[-2].startswith("ValueError:") and "mismatch" in res[-2], res
        assert res[-1] == [2.0, 2.0]
    assert r1[2].startswith("ValueError: recv: out tensors must be dense"), r1


def _closed(comm):
    with comm.dup() as d:
        pass
    return _raised(lambda: d.all_reduce(torch.ones(2)))


def test_row_comm_errors_closed_and_small_shm(pools, monkeypatch, shm_dir):
    """A closed communicator, a shm directory too small (here: statvfs says
    16 KiB are free; tests/test_segments.py mounts a real tiny tmpfs where it
    can), a set-up failure (a directory that does not exist): CommError."""
    for res in pools.run(2, _closed):
        assert res.startswith("CommError: all_reduce: the Communicator is closed"), res
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = 4096, 4

    monkeypatch.setattr(segment.os, "statvfs", lambda d: Small(real(d)))
    with pytest.raises(tpcomm.CommError, match="--shm-size"):
        segment.create(2, 1 << 20, "gtest")
    assert os.listdir(shm_dir) == [] or all(not n.startswith("tpcomm") for n in os.listdir(shm_dir))
    monkeypatch.undo()
    monkeypatch.setenv("TPCOMM_SHM_DIR", os.path.join(shm_dir, "missing"))
    with pytest.raises(tpcomm.CommError, match="TPCOMM_SHM_DIR"):
        segment.create(2, 1 << 20, "gtest")


def _dies(comm):
    if comm.rank == 1:
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(4))
    except tpcomm.PeerFailedError as e:
        return e.rank
    return "no error"


def test_row_peer_failed():
    """A peer that died while this rank waited: PeerFailedError(.rank); at
    every world size and place in a call: tests/test_faults.py."""
    with LocalGroup(2, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        g.run(_dies, timeout=120)
    assert info.value.rank == 1


def _stays_away(comm):
    if comm.rank == 1:
        time.sleep(3.0)
        return "away"
    return _raised(lambda: comm.all_reduce(torch.ones(4)))


def test_row_timeout():
    """A live peer that never joins within the timeout: CommTimeoutError
    (tests/test_faults.py: on every waiting rank)."""
    with LocalGroup(2, timeout=1.0) as g:
        res = g.run(_stays_away, timeout=60)
    assert res[0].startswith("CommTimeoutError"), res


def _two_threads(comm):
    if comm.rank == 1:
        time.sleep(1.0)
        comm.all_reduce(torch.ones(4))
        return None, comm.all_reduce(torch.ones(2)).tolist()
    inside = threading.Thread(target=lambda: comm.all_reduce(torch.ones(4)))
    inside.start()
    while not _testing.engine(comm).in_use:
        time.sleep(0.001)
    second = _raised(lambda: comm.barrier())
    inside.join(SLACK_S + 60)
    return second, comm.all_reduce(torch.ones(2)).tolist()


def test_row_second_thread():
    """A second thread calling while another thread of the rank is inside a
    call: CommError, nothing touched, the communicator still usable (every
    call: tests/test_threads.py)."""
    with LocalGroup(2, timeout=60) as g:
        second, after = g.run(_two_threads, timeout=120)[0]
    assert second.startswith("CommError: barrier: another thread of rank 0 is inside"), second
    assert after == [2.0, 2.0]


def _malformed(comm):
    if comm.rank == 0:
        _testing.send_raw(comm, 1, (2**40).to_bytes(8, "little") * 2)
        return _raised(lambda: comm.barrier())
    return _raised(lambda: comm.recv(0))


def test_row_malformed_message():
    """A message whose lengths cannot be right: CommError naming the sender,
    on the receiver and the sender (tests/test_p2p.py: header and data)."""
    with LocalGroup(2, timeout=20) as g:
        sent, got = g.run(_malformed, timeout=60)
    assert got.startswith("CommError") and "rank 0 sent rank 1" in got, got
    assert sent.startswith("CommError") and "rank 0 sent a point-to-point" in sent, sent


def _closed_by_watchdog(comm):
    if comm.rank == 1:
        time.sleep(2.0)
        return _raised(lambda: comm.all_reduce(torch.ones(4)))
    box = {}
    t = threading.Thread(
        target=lambda: box.update(e=_raised(lambda: comm.all_reduce(torch.ones(4))))
    )
    t.start()
    while not _testing.engine(comm).in_use:
        time.sleep(0.001)
    comm.close()
    t.join(SLACK_S + 60)
    return box["e"]


def test_row_close_from_another_thread():
    """close() from another thread during a call: that call CommError, the
    peers PeerFailedError (tests/test_threads.py: every kind of call)."""
    with LocalGroup(2, timeout=60) as g:
        mine, peer = g.run(_closed_by_watchdog, timeout=120)
    assert mine.startswith("CommError") and "another thread closed" in mine, mine
    assert peer.startswith("PeerFailedError") and "rank 0 closed" in peer, peer


def _raises(comm):
    if comm.rank == 1:
        raise RuntimeError("boom")
    return comm.rank


def test_row_launch_error():
    """A rank of tpcomm.launch that raised: LaunchError(.rank,
    .remote_traceback) (dying ranks: tests/test_faults.py)."""
    with pytest.raises(tpcomm.LaunchError) as info:
        tpcomm.launch(_raises, 2, timeout=60)
    assert info.value.rank == 1 and "boom" in info.value.remote_traceback

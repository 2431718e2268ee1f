"""One thread at a time: a second thread's call is refused, close() aborts.

A Communicator serves one thread at a time (docs/ENGINE.md, "Threads").  A
call made while another thread of the same rank is inside one (or holds the
engine between the native calls of one operation) raises CommError at once,
touches nothing, and leaves the communicator usable.  close() from another
thread aborts the running call (CommError there, PeerFailedError on the
peers) and returns once it has left.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tpcomm
from tpcomm import _testing
from tpcomm.launch import LocalGroup
from tpcomm.shm import engine as shm_engine
from tpcomm.shm import messages

from ._helpers import SLACK_S


def _wait_for(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


def _refused_calls(comm):
    """Every kind of call, each of which must be refused while another thread
    of this rank is inside a call: (name, what it did or raised, tensor intact)."""
    x = torch.arange(8.0)
    strided = torch.arange(16.0)[::2]
    calls = {
        "all_reduce": lambda: comm.all_reduce(x),  # the C fast path
        "all_reduce strided": lambda: comm.all_reduce(strided),  # the Python path
        "all_gather": lambda: comm.all_gather(x),
        "all_gather dim 1": lambda: comm.all_gather(x.view(2, 4), dim=1),
        "all_gatherv": lambda: comm.all_gatherv(x, [8, 8]),
        "reduce_scatter": lambda: comm.reduce_scatter(x),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(torch.empty(4), x),
        "gather": lambda: comm.gather(x, dst=0),
        "broadcast": lambda: comm.broadcast(x, src=0),
        "barrier": lambda: comm.barrier(),
        "send": lambda: comm.send([x], dst=1),
        "recv": lambda: comm.recv(src=1),
        "recv out": lambda: comm.recv(src=1, out=[torch.empty(8)]),
        "send_tensor_dict": lambda: comm.send_tensor_dict({"a": x, "n": 1}, dst=1),
        "empty": lambda: comm.empty((4,)),
    }
    out = []
    for name, call in calls.items():
        try:
            call()
            got = "no error"
        except tpcomm.CommError as e:
            got = str(e)
        intact = torch.equal(x, torch.arange(8.0)) and torch.equal(strided, torch.arange(16.0)[::2])
        out.append((name, got, intact))
    return out


def refused_while_inside(comm):
    r = comm.rank
    mine = torch.arange(4.0) + 10 * r
    if r == 1:
        time.sleep(2.0)  # rank 0's thread waits in the all_gather meanwhile
        gathered = comm.all_gather(mine)
        return gathered.tolist(), comm.all_reduce(torch.ones(3)).tolist()
    box = {}

    def inside():
        box["gathered"] = comm.all_gather(mine).tolist()

    t = threading.Thread(target=inside)
    t.start()
    _wait_for(lambda: _testing.engine(comm).in_use)
    refused = _refused_calls(comm)
    still_waiting = t.is_alive()
    t.join(30)
    return box.get("gathered"), comm.all_reduce(torch.ones(3)).tolist(), refused, still_waiting


def test_a_second_thread_is_refused_and_the_first_unharmed(pools):
    res = pools.run(2, refused_while_inside)
    want = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    gathered, summed, refused, still_waiting = res[0]
    assert still_waiting, "the refused calls must run while the other thread waits"
    assert gathered == want and res[1][0] == want  # the waiting call completed
    assert summed == [2.0] * 3 and res[1][1] == [2.0] * 3  # and the communicator works
    for name, got, intact in refused:
        fn = name.split()[0]
        assert got.startswith(f"{fn}: another thread of rank 0 is inside a call"), (name, got)
        assert "still usable" in got, got
        assert intact, name


class _SlowPickle:
    """messages.pickle, whose loads waits for an event: a receiving thread
    stops between a message's header and its body."""

    def __init__(self, real):
        self.real = real
        self.inside = threading.Event()
        self.go = threading.Event()

    def loads(self, data):
        self.inside.set()
        self.go.wait(30)
        return self.real.loads(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def refused_between_header_and_body(comm):
    r = comm.rank
    if r == 1:
        comm.send_tensor_dict({"w": torch.arange(5.0), "step": 7}, dst=0)
        return comm.all_reduce(torch.ones(2)).tolist()
    slow = _SlowPickle(messages.pickle)
    messages.pickle = slow
    try:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("d", comm.recv_tensor_dict(1)))
        t.start()
        assert slow.inside.wait(30)
        # the receiving thread is in Python, outside any native call: the header's hold
        # keeps the others out
        refused = _refused_calls(comm)
        slow.go.set()
        t.join(30)
    finally:
        messages.pickle = slow.real
    d = box.get("d")
    ok = d is not None and d["step"] == 7 and torch.equal(d["w"], torch.arange(5.0))
    return ok, comm.all_reduce(torch.ones(2)).tolist(), refused


def test_a_received_header_holds_until_its_body_is_read(pools):
    res = pools.run(2, refused_between_header_and_body)
    ok, summed, refused = res[0]
    assert ok
    assert summed == res[1] == [2.0, 2.0]
    for name, got, intact in refused:
        assert "another thread of rank 0 is inside a call" in got, (name, got)
        assert intact, name


def closed_by_another_thread(comm, where, closed_mark):
    """Rank 0's thread waits in a call rank 1 joins only once rank 0 closed the
    communicator under it (rank 0's main thread, then it writes closed_mark):
    the call can only have ended through close()."""
    r = comm.rank
    if r == 1:
        _wait_for(lambda: os.path.exists(closed_mark), seconds=120)
        try:
            comm.all_reduce(torch.ones(4))
            return "no error"
        except tpcomm.PeerFailedError as e:
            return [type(e).__name__, str(e), e.rank]
    box = {}

    def inside():
        t0 = time.monotonic()
        try:
            if where == "all_reduce":
                comm.all_reduce(torch.ones(4))
            elif where == "large all_reduce":  # the GIL is released for the whole call
                comm.all_reduce(torch.ones(1 << 21))
            elif where == "sendrecv":  # a small one: the wait lets the GIL go once it yields
                comm.sendrecv([torch.ones(4)], 1, 1, out=[torch.empty(4)])
            else:
                comm.recv(src=1)
            box["err"] = "no error"
        except tpcomm.CommError as e:
            box["err"] = [type(e).__name__, str(e)]
        box["t"] = time.monotonic() - t0

    t = threading.Thread(target=inside)
    t.start()
    _wait_for(lambda: _testing.engine(comm) is not None and _testing.engine(comm).in_use)
    time.sleep(0.2)
    t0 = time.monotonic()
    comm.close()
    closing = time.monotonic() - t0
    t.join(30)
    open(closed_mark, "w").close()
    return box["err"], box["t"], closing, comm.closed


@pytest.mark.parametrize("where", ["all_reduce", "large all_reduce", "recv", "sendrecv"])
def test_close_from_another_thread_aborts_the_call(where, tmp_path):
    mark = str(tmp_path / "closed")
    with LocalGroup(2, timeout=60) as g:  # the communicators' own timeout: 300 s
        (err, waited, closing, closed), peer = g.run(
            closed_by_another_thread, where, mark, timeout=180
        )
    assert closed
    assert closing < SLACK_S, closing
    assert waited < 0.2 + SLACK_S, waited  # rank 1 joined only after the close
    assert err[0] == "CommError" and "another thread closed this Communicator" in err[1], err
    assert peer[0] == "PeerFailedError" and peer[2] == 0, peer
    assert "rank 0 closed its communicator" in peer[1], peer


def close_gives_up_on_a_thread_that_stays(comm):
    """close() while another thread holds the engine between two native calls
    and does not come back in time: RuntimeError, nothing closed; once that
    thread is done, close() works."""
    if comm.rank == 1:
        comm.send_tensor_dict({"w": torch.ones(3), "step": 1}, dst=0)
        time.sleep(0.5)
        try:
            comm.barrier()
            return "no error"
        except tpcomm.PeerFailedError as e:
            return e.rank
    slow = _SlowPickle(messages.pickle)
    messages.pickle = slow
    wait = shm_engine.CLOSE_WAIT_S
    shm_engine.CLOSE_WAIT_S = 0.3
    box = {}

    def inside():
        try:
            comm.recv_tensor_dict(1)
            box["err"] = "no error"
        except tpcomm.CommError as e:
            box["err"] = str(e)

    try:
        t = threading.Thread(target=inside)
        t.start()
        assert slow.inside.wait(30)
        try:
            comm.close()
            first = "no error"
        except RuntimeError as e:
            first = str(e)
        open_after = not comm.closed
        slow.go.set()
        t.join(30)
    finally:
        messages.pickle = slow.real
        shm_engine.CLOSE_WAIT_S = wait
    comm.close()
    return first, open_after, box.get("err"), comm.closed


def test_close_gives_up_on_a_thread_that_stays():
    with LocalGroup(2, timeout=60) as g:
        (first, open_after, err, closed), peer = g.run(
            close_gives_up_on_a_thread_that_stays, timeout=60
        )
    assert "still inside a call" in first, first
    assert open_after and closed
    # the thread's receive ends (its message was already in the ring: it may
    # complete) and the peer learns that rank 0 closed the communicator
    assert err == "no error" or "another thread closed this Communicator" in err, err
    assert peer == 0


def two_threads_two_communicators(comm):
    """The way to communicate from two threads at once: a dup() per thread. Both
    run collectives and sendrecv concurrently; results are checked; closing the
    dup leaves the original working."""
    r, w = comm.rank, comm.world_size
    second = comm.dup()
    res = {}

    def loop(c, name, calls):
        ok = c.rank == r and c.world_size == w and (c is not comm) == (name == "second")
        for i in range(calls):
            x = torch.full((1000 + i,), float(r + i))
            c.all_reduce(x)
            ok = ok and bool((x == sum(float(q + i) for q in range(w))).all())
            if w > 1:
                (got,) = c.sendrecv([torch.full((70_000,), float(r))], (r + 1) % w, (r - 1) % w)
                ok = ok and bool((got == float((r - 1) % w)).all())
        res[name] = ok

    threads = [
        threading.Thread(target=loop, args=(comm, "first", 200)),
        threading.Thread(target=loop, args=(second, "second", 200)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    second.close()
    res["original after"] = comm.all_reduce(torch.ones(2)).tolist() == [float(w)] * 2
    return res


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_dup_per_thread_runs_at_once(pools, world):
    for res in pools.run(world, two_threads_two_communicators):
        assert res == {"first": True, "second": True, "original after": True}, res


def _tpcomm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "tpcomm-" in line)


def dup_and_parent_at_once_then_closed(comm):
    """A communicator and its dup() used at once from two threads (every kind of
    call, empty() buffers included), then both closed: nothing of either stays
    mapped but the empty() buffers whose tensors the caller still holds, this
    rank's own mapping of each, and those go with the tensors."""
    d = comm.dup()
    keep, errors = [], []

    def loop(c):
        try:
            for i in range(10):
                n = 1 << 16
                c.all_reduce(torch.ones(n))
                c.all_gather(torch.ones(n))
                if c.rank == 0:
                    c.send([torch.ones(n)], 1)
                else:
                    c.recv(0)
                t = c.empty((n,))
                t.fill_(1.0)
                c.all_reduce(t)
                if i % 5 == 0:
                    keep.append(t)
                c.barrier()
        except Exception as e:  # reported, not lost in the thread
            errors.append(repr(e))

    threads = [threading.Thread(target=loop, args=(c,)) for c in (comm, d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.close()
    comm.close()
    held = _tpcomm_mappings()
    keep.clear()
    return errors, held, _tpcomm_mappings()


def test_nothing_stays_mapped_after_a_dup_used_from_two_threads_is_closed():
    for errors, held, after in tpcomm.launch(dup_and_parent_at_once_then_closed, 2, timeout=60):
        assert errors == []
        assert held == 4  # two kept tensors per communicator, own mapping only
        assert after == 0

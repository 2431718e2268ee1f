"""send/recv of tensor lists and tensor dicts.

Guards: any count (0 .. hundreds), shapes (0-d, empty, non-contiguous, larger than
the channel), dtypes (bool, int8, uint8, float64, complex); in-order delivery
between a pair; send not waiting when a slot is free; several pairs at once; dicts
with non-tensor values; a dead peer during recv -> PeerFailedError.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import tpcomm
from tpcomm import _testing
from tpcomm.launch import LocalGroup

from ._helpers import SLACK_S, assert_survivors_saw, comm_error_of, unexpected_errors
from ._ref import MOVE_DTYPES, make


def _payload(seed: int, big: int):
    ts = [make(0, (3, 4), dt, seed + i) for i, dt in enumerate(MOVE_DTYPES)]
    ts.append(torch.tensor(2.5, dtype=torch.float64))  # 0-d
    ts.append(make(0, (2, 1, 3, 1, 2, 1, 2, 2), torch.bfloat16, seed + 7))  # 8-d, the most plain
    ts.append(torch.empty(0, 7, dtype=torch.int16))  # empty
    ts.append(make(0, (6, 8), torch.float32, seed)[:, ::3])  # non-contiguous
    ts.append(make(0, (big,), torch.float32, seed + 99))  # larger than a channel slot
    return ts


def many_shapes(comm, big):
    if comm.rank == 0:
        comm.send(_payload(1, big), dst=1)
        comm.send([], dst=1)
        comm.send([torch.ones(1) * k for k in range(300)], dst=1)  # > 255: pickled header
        comm.send([torch.arange(512.0).reshape((2,) * 9)], dst=1)  # 9-d: pickled header
        return None
    if comm.rank == 1:
        # plain messages take recv's one C call (p2p_recv_new); pickled headers
        # (more than 255 tensors, more than 8 dims) the Python path: count those
        from tpcomm.shm import messages

        real, python = messages.recv_rest, []

        def spy(*args):
            python.append(1)
            return real(*args)

        messages.recv_rest = spy
        try:
            a = comm.recv(src=0)
            b = comm.recv(src=0)
            plain = len(python)
            c = comm.recv(src=0)
            (d,) = comm.recv(src=0)
        finally:
            messages.recv_rest = real
        if (plain, len(python)) != (0, 2):
            return f"Python receives: {plain} of the plain messages, {len(python)} in all"
        want = _payload(1, big)
        ok = len(a) == len(want) and all(
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, want)
        )
        ok = ok and torch.equal(d, torch.arange(512.0).reshape((2,) * 9))
        return ok, b, len(c), [float(t.item()) for t in c] == [float(k) for k in range(300)]
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_any_tensors_arrive_intact(pools, world):
    from tpcomm import _env

    big = 3 * _env.DEFAULT_SLOT_BYTES // 4 + 11
    res = pools.run(world, many_shapes, big)
    assert not isinstance(res[1], str), res[1]
    ok, empty, n, values = res[1]
    assert ok and empty == [] and n == 300 and values


def ordered_and_nonblocking(comm):
    r, w = comm.rank, comm.world_size
    # every rank sends 50 small messages to its right neighbour before receiving:
    # send must not wait for the receiver while a chunk of the channel is free; a
    # send once the channel's ring is full waits; interleave to keep the ring moving
    right, left = (r + 1) % w, (r - 1) % w
    got = []
    t0 = time.monotonic()
    comm.send([torch.tensor([r, 0])], dst=right)  # returns at once: a slot is free
    first_send = time.monotonic() - t0
    got.append(comm.recv(src=left)[0].tolist())
    for k in range(1, 50):
        comm.send([torch.tensor([r, k])], dst=right)
        got.append(comm.recv(src=left)[0].tolist())
    return first_send, got


@pytest.mark.parametrize("world", [2, 4])
def test_ring_in_order(pools, world):
    res = pools.run(world, ordered_and_nonblocking)
    for r, (first_send, got) in enumerate(res):
        left = (r - 1) % world
        assert got == [[left, k] for k in range(50)]
        assert first_send < SLACK_S  # a send that waited for its receiver: 30 s


def both_directions(comm):
    other = 1 - comm.rank
    comm.send([torch.full((100,), comm.rank)], dst=other)  # both send first
    comm.send([torch.full((3,), comm.rank + 10)], dst=other)
    a = comm.recv(src=other)[0]
    b = comm.recv(src=other)[0]
    return a.tolist() == [other] * 100 and b.tolist() == [other + 10] * 3


def test_both_directions_at_once(pools):
    assert pools.run(2, both_directions) == [True, True]


def dicts(comm):
    if comm.rank == 0:
        comm.send_tensor_dict(
            {
                "h": torch.arange(6).reshape(2, 3),
                "step": 3,
                "names": ["a", "b"],
                "mask": torch.tensor([True, False]),
                "none": None,
            },
            dst=1,
        )
        comm.send_tensor_dict({}, dst=1)
        return None
    d = comm.recv_tensor_dict(src=0)
    e = comm.recv_tensor_dict(src=0)
    return (list(d), d["h"].tolist(), d["step"], d["names"], d["mask"].tolist(), d["none"], e)


def test_tensor_dicts(pools):
    keys, h, step, names, mask, none, empty = pools.run(2, dicts)[1]
    assert keys == ["h", "step", "names", "mask", "none"]
    assert h == [[0, 1, 2], [3, 4, 5]] and step == 3 and names == ["a", "b"]
    assert mask == [True, False] and none is None and empty == {}


def bad_p2p(comm):
    return unexpected_errors(
        [
            (
                lambda: comm.send(torch.ones(2), dst=1 - comm.rank),
                TypeError,
                "must be a list or tuple",
            ),
            (
                lambda: comm.send([torch.ones(2), 3], dst=1 - comm.rank),
                TypeError,
                "tensors[1] must be",
            ),
            (lambda: comm.send([torch.ones(2)], dst=comm.rank), ValueError, "is this rank"),
            (lambda: comm.send([torch.ones(2)], dst=5), ValueError, "dst=5 is out of range"),
            (lambda: comm.recv(src=comm.rank), ValueError, "is this rank"),
            (lambda: comm.send([torch.ones(2)], dst=True), TypeError, "dst must be an int"),
            (lambda: comm.recv(src=5, out=[torch.ones(2)]), ValueError, "src=5 is out of range"),
            (lambda: comm.recv(src=1 - comm.rank, out=[2]), TypeError, "tensors[0] must be"),
            (lambda: comm.recv(src=1 - comm.rank, out=torch.ones(2)), TypeError, "list or tuple"),
            (lambda: comm.send_tensor_dict([1], dst=1 - comm.rank), TypeError, "must be a dict"),
            (lambda: comm.sendrecv(torch.ones(2), 1 - comm.rank, 1 - comm.rank), TypeError, "list"),
            (lambda: comm.sendrecv([torch.ones(2)], comm.rank, 0), ValueError, "is this rank"),
            (lambda: comm.sendrecv([], 1 - comm.rank, 7), ValueError, "src=7 is out of range"),
            (
                lambda: comm.sendrecv([], 1 - comm.rank, 1 - comm.rank, out=[1]),
                TypeError,
                "tensors[0] must be",
            ),
            # arguments of the wrong form: as Python reports them
            (
                lambda: comm.sendrecv([torch.ones(2)], 1 - comm.rank, 1 - comm.rank, bogus=1),
                TypeError,
                "bogus",
            ),
            (lambda: comm.sendrecv([torch.ones(2)], 1 - comm.rank), TypeError, "src"),
            (
                lambda: comm.sendrecv([torch.ones(2)], 1 - comm.rank, 1 - comm.rank, None, 5),
                TypeError,
                "positional",
            ),
        ]
    )


def test_bad_p2p_arguments(pools):
    assert pools.run(2, bad_p2p) == [[], []]


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def killed_while_others_wait(comm, where, outdir):
    r = comm.rank
    if r == 0:
        time.sleep(0.2)
        _write(os.path.join(outdir, "killed"), time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if where == "recv":
            comm.recv(src=0)
        elif where == "recv_any":
            comm.recv_any()
        elif where == "gather":
            comm.gather(torch.ones(10), dst=1)
        elif where == "broadcast":
            comm.broadcast(torch.ones(10), src=0)
        elif where == "all_gather rows":
            comm.all_gather(torch.ones(3, 10), dim=-1)
        elif where == "reduce_scatter rows":
            comm.reduce_scatter(torch.ones(2, 3 * 10), dim=-1)
        elif where == "all_to_all":  # the backend's all_to_all_single rounds
            from tpcomm.shm.engine import KIND_ALL_TO_ALL
            from tpcomm.shm.keys import flat_key

            x, out, n = torch.ones(30), torch.empty(30), 40
            eng = _testing.engine(comm)
            status = eng.alltoallv(
                KIND_ALL_TO_ALL, x.data_ptr(), [n] * 3, [0, n, 2 * n], out.data_ptr(),
                [n] * 3, [0, n, 2 * n], n, 0, n, flat_key(KIND_ALL_TO_ALL, n, 3),
            )  # fmt: skip
            if status:
                eng.raise_status(status, "all_to_all")
        elif where == "recv_into":
            comm.recv(src=0, out=[torch.empty(10)])
        elif where == "batch":  # sends and a recv progressed together (p2p_batch)
            from tpcomm.shm import messages

            eng = _testing.engine(comm)
            big = torch.ones(1 << 20)  # more than the ring: the send waits for rank 0
            got = torch.empty(10)
            ops = [
                (1, 0, messages.message_pieces(eng, [big], None)),
                (0, 0, messages.expected_header(eng, [got]), [(got.data_ptr(), 40)]),
            ]
            messages.batch(eng, "send/recv", ops)
        elif where == "send":  # fill the channel's ring, then wait for a receiver that is gone
            for _ in range(_testing.engine(comm).p2p_ring + 1):
                comm.send([torch.ones(10)], dst=0)
        res = "no error"
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.time()]
    _write(os.path.join(outdir, f"rank{r}"), res)
    return res


@pytest.mark.parametrize(
    "where",
    [
        "recv",
        "recv_any",
        "recv_into",
        "gather",
        "broadcast",
        "send",
        "all_gather rows",
        "reduce_scatter rows",
        "all_to_all",
        "batch",
    ],
)
def test_dead_peer_during_p2p_and_rooted_collectives(tmp_path, where):
    with LocalGroup(3, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        g.run(killed_while_others_wait, where, str(tmp_path), timeout=60)
    assert info.value.rank == 0
    assert_survivors_saw(tmp_path, 0, (1, 2))


def crossed_calls(comm, which):
    """Rank 0 enters a collective while rank 1 waits for it in a point-to-point
    call: both must fail fast (not at the timeout), each saying what crossed."""
    r = comm.rank

    def call():
        if r == 0:
            comm.all_reduce(torch.ones(4)) if which == "all_reduce" else comm.barrier()
        elif which == "all_reduce":
            comm.recv(src=0)
        else:  # the sender waits: the ring to rank 0 is full, rank 0 never receives
            for _ in range(_testing.engine(comm).p2p_ring + 1):
                comm.send([torch.ones(4)], dst=0)

    t0 = time.time()
    res = comm_error_of(call)
    return res, time.time() - t0


@pytest.mark.parametrize("which", ["all_reduce", "barrier"])
def test_collective_crossing_p2p_fails_fast_on_both_sides(which):
    with LocalGroup(2, timeout=60) as g:  # the communicators' own timeout: 300 s
        res = g.run(crossed_calls, which, timeout=60)
    (err0, t0), (err1, t1) = res
    assert err0 != "no error" and "point-to-point" in err0[1] and "crossed" in err0[1], err0
    assert err1 != "no error" and "rank 0 waited for this rank in a collective" in err1[1], err1
    assert t0 < SLACK_S and t1 < SLACK_S, (t0, t1)
    assert err0[0] == err1[0] == "CommError"


def recv_into(comm):
    if comm.rank == 0:
        comm.send([torch.arange(6).reshape(2, 3), torch.tensor(1.5)], dst=1)
        comm.send([torch.ones(4)], dst=1)
        comm.send([torch.ones(2)], dst=1)
        comm.send((torch.arange(512.0).reshape((2,) * 9),), dst=1)  # 9-d: pickled header
        comm.send([torch.nn.Parameter(torch.full((3,), 2.0))], dst=1)  # a subclass
        comm.send([torch.arange(4).to(torch.int16)], dst=1)
        return None
    a, b = torch.empty(2, 3, dtype=torch.int64), torch.empty((), dtype=torch.float32)
    got = comm.recv(0, out=[a, b])
    same = got[0] is a and got[1] is b and a.tolist() == [[0, 1, 2], [3, 4, 5]] and b == 1.5
    try:
        comm.recv(0, out=[torch.empty(5)])  # wrong shape: received, then an error
        err = "no error"
    except ValueError as e:
        err = str(e)
    nxt = comm.recv(0)[0].tolist()  # the channel is still in step
    nine = torch.empty((2,) * 9)
    same = same and comm.recv(0, out=(nine,))[0] is nine
    same = same and torch.equal(nine, torch.arange(512.0).reshape((2,) * 9))
    (p,) = comm.recv(0, out=[torch.empty(3)])
    same = same and p.tolist() == [2.0, 2.0, 2.0]
    wrong = torch.empty(4, dtype=torch.int32)  # same shape, another dtype
    try:
        comm.recv(0, out=[wrong])
        err2 = "no error"
    except ValueError as e:
        err2 = str(e)
    same = same and "int16" in err2 and "int32" in err2
    return same, err, nxt


def test_recv_into_buffers(pools):
    same, err, nxt = pools.run(2, recv_into)[1]
    assert same
    assert "recv: rank 0 sent" in err and "out=" in err
    assert nxt == [1.0, 1.0]


def eager_up_to_the_ring(comm):
    """A channel holds p2p_ring messages: that many sends return before the
    receiver takes any (the next one would wait), and they arrive in order."""
    ring = _testing.engine(comm).p2p_ring
    if comm.rank == 0:
        for k in range(ring):
            comm.send([torch.tensor([k])], dst=1)
        comm.barrier()  # reached only if no send waited for the receiver
        return ring
    comm.barrier()
    return [int(comm.recv(src=0)[0]) for _ in range(ring)]


def test_sends_are_eager_up_to_the_ring(pools):
    ring, got = pools.run(2, eager_up_to_the_ring)
    assert ring >= 16 and got == list(range(ring))


def large_one_way(comm, n):
    # one message of n float64 values through a ring of small chunks, both into
    # a fresh tensor and into out=
    if comm.rank == 0:
        x = torch.arange(n, dtype=torch.float64)
        comm.send([x], dst=1)
        comm.send([x * 2], dst=1)
        return None
    a = comm.recv(src=0)[0]
    b = torch.empty(n, dtype=torch.float64)
    comm.recv(src=0, out=[b])
    want = torch.arange(n, dtype=torch.float64)
    return bool(torch.equal(a, want)) and bool(torch.equal(b, want * 2))


@pytest.mark.parametrize("n", [1, 8191, 8192 * 16 + 5, 3 * (1 << 20) // 8 + 7])
def test_messages_across_chunk_boundaries(pools, n):
    assert pools.run(2, large_one_way, n)[1] is True


def tiny_chunks(comm):
    """With the smallest slot (4 KiB) a channel's chunks are 128 bytes: headers,
    pickled headers, dicts and data all cross chunk boundaries."""
    lay = _testing.layout(comm)
    if comm.rank == 0:
        comm.send([torch.arange(1000.0), torch.tensor(7), torch.zeros(0, 3)], dst=1)
        comm.send([torch.arange(512.0).reshape((2,) * 9)], dst=1)  # 9-d: pickled header
        comm.send_tensor_dict({"a": torch.arange(300).reshape(3, 100), "n": "x" * 500}, dst=1)
        for k in range(200):  # far more messages than the ring holds
            comm.send([torch.tensor([k])], dst=1)
        return lay["p2p_piece"]
    a, b, c = comm.recv(src=0)
    (d,) = comm.recv(src=0)
    e = comm.recv_tensor_dict(src=0)
    out = torch.empty(1, dtype=torch.int64)
    ks = [int(comm.recv(src=0, out=[out])[0]) for _ in range(200)]
    return (
        torch.equal(a, torch.arange(1000.0))
        and int(b) == 7
        and tuple(c.shape) == (0, 3)
        and torch.equal(d, torch.arange(512.0).reshape((2,) * 9))
        and torch.equal(e["a"], torch.arange(300).reshape(3, 100))
        and e["n"] == "x" * 500
        and ks == list(range(200))
    )


def test_tiny_slots_stream_across_chunks(monkeypatch):
    monkeypatch.setenv("TPCOMM_SLOT_BYTES", "4096")
    with LocalGroup(2, timeout=30) as g:
        piece, ok = g.run(tiny_chunks, timeout=120)
    assert piece == 128 and ok is True


def shifts_and_exchanges(comm):
    """sendrecv: around a ring with messages several times the channel's ring (a
    send-then-recv on every rank would wait for ever), both ways with one
    neighbour into out=, mixed dtypes whose bytes are not aligned, a wrong out=."""
    r, w = comm.rank, comm.world_size
    right, left = (r + 1) % w, (r - 1) % w
    big = 1 << 20  # 4 MiB of float32
    res = {}
    got = comm.sendrecv([torch.arange(big, dtype=torch.float32) + r], right, left)
    res["ring"] = len(got) == 1 and torch.equal(
        got[0], torch.arange(big, dtype=torch.float32) + left
    )
    peer = r ^ 1
    if peer < w:
        into = torch.empty(big, dtype=torch.int64)
        got = comm.sendrecv([torch.full((big,), r, dtype=torch.int64)], peer, peer, out=[into])
        res["pair"] = got[0] is into and bool((into == peer).all())
    mixed = [
        torch.tensor([True, False, r % 2 == 0]),
        torch.arange(5, dtype=torch.float32) * (r + 1),
        torch.arange(7, dtype=torch.int16) + r,
        torch.tensor(2.5 + r, dtype=torch.float64),
    ]
    got = comm.sendrecv(mixed, right, left)
    want = [
        torch.tensor([True, False, left % 2 == 0]),
        torch.arange(5, dtype=torch.float32) * (left + 1),
        torch.arange(7, dtype=torch.int16) + left,
        torch.tensor(2.5 + left, dtype=torch.float64),
    ]
    res["mixed"] = all(
        g.dtype == x.dtype and g.shape == x.shape and torch.equal(g, x) for g, x in zip(got, want)
    )
    # into new tensors made from the header as it arrives, an empty one among them
    got = comm.sendrecv(mixed + [torch.empty(0, 3, dtype=torch.float16)], right, left)
    res["mixed into new, with an empty one"] = (
        len(got) == 5
        and all(g.dtype == x.dtype and torch.equal(g, x) for g, x in zip(got, want))
        and got[4].shape == (0, 3)
        and got[4].dtype == torch.float16
    )
    # the same into out= (one C call), with an empty tensor, and a transposed
    # (not contiguous) tensor sent: the C call declines it, the general path runs
    outs = [torch.empty_like(x) for x in want] + [torch.empty(0, 3)]
    got = comm.sendrecv(mixed + [torch.empty(0, 3)], right, left, out=outs)
    res["mixed into out"] = all(g is o for g, o in zip(got, outs)) and all(
        torch.equal(o, x) for o, x in zip(outs, want)
    )
    grid = torch.arange(12, dtype=torch.float32).view(3, 4) + r
    into = torch.empty(4, 3)
    got = comm.sendrecv([grid.t()], right, left, out=[into])
    res["transposed"] = got[0] is into and torch.equal(into, (grid - r + left).t())
    try:
        comm.sendrecv([torch.ones(3)], right, left, out=[torch.empty(4)])
        res["wrong out"] = "no error"
    except ValueError as e:
        res["wrong out"] = str(e)
    got = comm.sendrecv([torch.full((2,), float(r))], right, left)
    res["in step"] = got[0].tolist() == [float(left)] * 2
    # every way of naming the arguments: out positional, all by keyword
    into = torch.empty(2)
    got = comm.sendrecv([torch.full((2,), float(r))], right, left, [into])
    res["out positional"] = got[0] is into and into.tolist() == [float(left)] * 2
    got = comm.sendrecv(src=left, out=(into,), dst=right, tensors=(torch.full((2,), 7.0 + r),))
    res["by keyword"] = got[0] is into and into.tolist() == [7.0 + left] * 2
    return res


def sendrecv_meets_a_dict(comm):
    """Rank 1's sendrecv (no out=) receives a dict rank 0 sent: its header is
    pickled, so no tensors are made from it: the message is received aside and
    reported, and the channels stay in step."""
    if comm.rank == 0:
        comm.send_tensor_dict({"w": torch.ones(2)}, 1)
        (got,) = comm.recv(1)
        res = got.tolist()
    else:
        try:
            comm.sendrecv([torch.full((3,), 5.0)], 0, 0)
            res = "no error"
        except tpcomm.CommError as e:
            res = str(e)
    comm.barrier()
    return res, comm.all_reduce(torch.ones(2)).tolist()


def test_sendrecv_into_new_tensors_reports_a_dict(pools):
    (got0, sum0), (err, sum1) = pools.run(2, sendrecv_meets_a_dict)
    assert got0 == [5.0, 5.0, 5.0]
    assert "rank 0 sent a dict" in err, err
    assert sum0 == sum1 == [2.0, 2.0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sendrecv_cannot_deadlock(pools, world):
    for res in pools.run(world, shifts_and_exchanges):
        err = res.pop("wrong out")
        assert err.startswith("sendrecv: rank") and "(4,)" in err and "(3,)" in err, err
        assert all(res.values()), res


def crafted_lengths(comm, which):
    """Rank 0 writes a message whose lengths wrap around 2**64; rank 1 receives."""
    import struct

    t0 = time.monotonic()
    if comm.rank == 0:
        if which == "header":
            stream = struct.pack("<QQ", 0xFFFFFFF0, 16)  # a 4 GiB header
        else:
            stream = struct.pack("<QQ", 2, 2**64 - 8) + b"\xb1\x00"  # data wraps the total
        _testing.send_raw(comm, 1, stream)
        try:
            comm.barrier()
            return "no error", time.monotonic() - t0
        except tpcomm.CommError as e:
            return str(e), time.monotonic() - t0
    try:
        comm.recv(0)
        return "no error", time.monotonic() - t0
    except tpcomm.CommError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("which", ["header", "data"])
def test_a_malformed_message_is_an_error_on_both_sides(which):
    """Lengths read from shared memory are checked before use: a message whose
    header or data length cannot be right (it made recv hang past its timeout)
    is a CommError naming the sender, at once, on the receiver and the sender."""
    with LocalGroup(2, timeout=20) as g:
        (sent, t_send), (got, t_recv) = g.run(crafted_lengths, which, timeout=60)
    assert "rank 0 sent rank 1 a point-to-point message whose lengths" in got, got
    assert "rank 0 sent a point-to-point message whose lengths" in sent, sent
    assert t_recv < SLACK_S and t_send < SLACK_S  # the timeout: 20 s


def many_to_one(comm):
    """Every other rank sends rank 0 five messages; rank 0 takes them with
    recv_any (some into out=): each once, each sender's in its order, src right."""
    r, w = comm.rank, comm.world_size
    got = []
    if r == 0:
        for i in range((w - 1) * 5):
            out = [torch.empty(2, dtype=torch.int64)] if i % 2 else None
            src, (t,) = comm.recv_any(out)
            got.append((src, t.tolist()))
    else:
        for i in range(5):
            if i == 2:
                time.sleep(0.01 * r)  # let the senders interleave
            comm.send([torch.tensor([r, i])], dst=0)
    comm.barrier()
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_recv_any_takes_every_message_once_in_each_senders_order(pools, world):
    got = pools.run(world, many_to_one)[0]
    by_src: dict = {}
    for src, (sender, i) in got:
        assert src == sender
        by_src.setdefault(src, []).append(i)
    assert by_src == {s: list(range(5)) for s in range(1, world)}


def nothing_comes(comm):
    t0 = time.time()
    err = comm_error_of(comm.recv_any) if comm.rank == 0 else None
    return err, time.time() - t0


def test_recv_any_times_out_when_nobody_sends():
    with LocalGroup(2, timeout=1.0) as g:
        (err, took), _ = g.run(nothing_comes, timeout=60)
    assert err[0] == "CommTimeoutError" and "from any rank" in err[1], err
    assert took < 1.0 + SLACK_S


def lying_header(comm, how, carried):
    """Rank 0 sends a binary header for one float32 tensor of 4 (16 bytes) with
    ``carried`` bytes of data, then a good message; rank 1 receives the first
    by ``how``, then the second by recv."""
    import struct

    from tpcomm.ops import ANY_DTYPE_CODES

    if comm.rank == 0:
        header = bytes([0xB1, 1, ANY_DTYPE_CODES[torch.float32], 1]) + struct.pack("<q", 4)
        data = b"\x01" * carried
        _testing.send_raw(comm, 1, struct.pack("<QQ", len(header), len(data)) + header + data)
        comm.send([torch.tensor([7.0])], 1)
        if how.startswith("sendrecv"):
            comm.recv(1)
        return None
    out = [torch.full((4,), -1.0)]
    calls = {
        "recv": lambda: comm.recv(0),
        "recv out=": lambda: comm.recv(0, out=out),
        "sendrecv": lambda: comm.sendrecv([torch.ones(2)], 0, 0),
        "sendrecv out=": lambda: comm.sendrecv([torch.ones(2)], 0, 0, out=out),
    }
    if how == "batch":
        (err,) = comm.batch_isend_irecv([("recv", out, 0)])
        first = [type(err).__name__, str(err)]
    else:
        first = comm_error_of(calls[how])
    return first, out[0].tolist(), comm.recv(0)[0].tolist()


@pytest.mark.parametrize("carried", [8, 24])
@pytest.mark.parametrize("how", ["recv", "recv out=", "sendrecv", "sendrecv out=", "batch"])
def test_a_header_that_lies_about_its_data_is_an_error_and_the_channel_stays_in_step(how, carried):
    """A binary header whose tensors do not add up to the data the message
    carries (a peer's bug): every receive raises (batch: reports) a CommError
    naming the sender and both sizes, out= is untouched, and the message is
    received and dropped, so the next one arrives whole."""
    with LocalGroup(2, timeout=20) as g:
        first, out, nxt = g.run(lying_header, how, carried, timeout=60)[1]
    assert first == [
        "CommError",
        f"{how.split()[0] if how != 'batch' else 'batch_isend_irecv'}: rank 0 sent a message "
        f"whose header describes 16 bytes of data, but it carried {carried}",
    ], first
    assert out == [-1.0] * 4
    assert nxt == [7.0]

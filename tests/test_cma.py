"""Single-copy all_gather (process_vm_readv): same results as the copy path,
one decision for every rank, and the failures a read can meet.

Guards: the single-copy path against torch's concatenation and against the
two-copy path, over the forms that take it (1-d, into a tensor, along dim 0,
in place, the list form, along a later dim where a rank's part is many
blocks of the result, down to one element each); an
independent check (ctypes, no tpcomm code) that this machine allows the reads
the engine says it can do; TPCOMM_CMA=0 on one rank turns them off for all; a
peer killed while it is being read -> PeerFailedError; a read refused while
every rank lives -> CommError on every rank, fast.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest
import torch

import tpcomm
from tpcomm import _env, _testing
from tpcomm.launch import LocalGroup

from ._helpers import assert_survivors_saw, comm_error_of, write_json
from ._ref import make

# the forms of all_gather, each returning the gathered tensor; "rows" gathers
# along dim 1 of an (m, n / m) view: every rank's part is m blocks of the result
FORMS = ("1-d", "into tensor", "dim 0", "rows", "one per row", "in place", "list")


def _rows(n: int) -> int:
    return next(m for m in (7, 4, 3, 2, 1) if n % m == 0)


def _expected(form: str, xs: list) -> torch.Tensor:
    n = xs[0].numel()
    if form == "rows":
        return torch.cat([x.view(_rows(n), -1) for x in xs], 1)
    if form == "one per row":
        return torch.cat([x.view(-1, 1) for x in xs], 1)
    return torch.cat(xs)


def _gather(comm, form: str, x: torch.Tensor) -> torch.Tensor:
    w, r = comm.world_size, comm.rank
    if form == "1-d":
        return comm.all_gather(x)
    if form == "into tensor":
        out = torch.empty(w * x.numel(), dtype=x.dtype)
        return comm.all_gather_into_tensor(out, x)
    if form == "dim 0":
        return comm.all_gather(x.view(-1, 1), 0).view(-1)
    if form == "rows":
        return comm.all_gather(x.view(_rows(x.numel()), -1), 1)
    if form == "one per row":  # one element per block: the most pieces a read can have
        return comm.all_gather(x.view(-1, 1), -1)
    if form == "in place":
        out = torch.empty(w * x.numel(), dtype=x.dtype)
        own = out[r * x.numel() : (r + 1) * x.numel()]
        own.copy_(x)
        return comm.all_gather_into_tensor(out, own)
    outs = [torch.empty_like(x) for _ in range(w)]  # the list form (dist.all_gather)
    assert comm._shm.gather_direct("all_gather", outs, x, None)
    return torch.cat(outs)


def _restore(comm) -> None:
    """Back to the default decision (the pools' communicators serve other tests)."""
    _testing.restore(comm)


def _can_read_peers(comm) -> bool:
    """Whether this rank can read every peer's memory, found without tpcomm's C
    code: each rank publishes a word's address, peers read it through libc."""
    libc = ctypes.CDLL(None, use_errno=True)

    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    word = ctypes.c_uint64(0x5EED0000 + comm.rank)
    me = torch.tensor([os.getpid(), ctypes.addressof(word)], dtype=torch.int64)
    table = comm.all_gather(me).view(-1, 2).tolist()
    ok = True
    for r, (pid, addr) in enumerate(table):
        if r == comm.rank:
            continue
        got = ctypes.c_uint64(0)
        local = iovec(ctypes.addressof(got), 8)
        remote = iovec(addr, 8)
        n = libc.process_vm_readv(
            pid, ctypes.byref(local), ctypes.c_ulong(1), ctypes.byref(remote), ctypes.c_ulong(1), 0
        )
        ok &= n == 8 and got.value == 0x5EED0000 + r
    comm.barrier()  # every peer read `word` before it goes away
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    comm.all_reduce(flag, tpcomm.ReduceOp.MIN)
    return bool(flag.item())


def both_paths(comm):
    w = comm.world_size
    possible = _can_read_peers(comm)
    bad = []
    try:
        for cma in (True, False):
            st, on = _testing.cma_init(comm, cma, 0)  # min 0: every size single-copy
            assert st == 0
            if on != (cma and possible):
                bad.append(("enabled", cma, on, possible))
            for n in (1, 1000, 16387, 300_000):
                for dt in (torch.float32, torch.bfloat16, torch.int8):
                    x = make(comm.rank, n, dt, n)
                    xs = [make(q, n, dt, n) for q in range(w)]
                    for form in FORMS:
                        got = _gather(comm, form, x)
                        if not torch.equal(got, _expected(form, xs)):
                            bad.append((cma, n, str(dt), form))
    finally:
        _restore(comm)
    return possible, bad


def all_to_all_both_paths(comm):
    """all_to_all_single, even and uneven splits (zeros included), single copy
    (every size) and two copies, against the blocks each rank must receive."""
    w, r = comm.world_size, comm.rank
    bad, possible = [], None
    try:
        for cma in (True, False):
            _, on = _testing.cma_init(comm, cma, 0)
            if cma:
                possible = on and comm.single_copy  # single copy really on for the first pass
            for rows in (1, 5000, 70_001):
                # rank q sends rank j `split(q, j)` rows of 3 (all zero for one pair)
                def split(q, j, rows=rows):
                    return 0 if (q, j) == (0, w - 1) else rows * (q + 1) + j

                def data(q, rows=rows):
                    n = sum(split(q, j) for j in range(w))
                    return make(q, (n, 3), torch.int32, rows)

                x = data(r)
                ins = [split(r, j) for j in range(w)]
                outs = [split(q, r) for q in range(w)]
                out = torch.empty(sum(outs), 3, dtype=torch.int32)
                comm.all_to_all_single(out, x, outs, ins)
                want = torch.cat(
                    [data(q).split([split(q, j) for j in range(w)])[r] for q in range(w)]
                )
                even = make(r, (w * rows, 2), torch.float32, 3)
                got_even = torch.empty_like(even)
                comm.all_to_all_single(got_even, even)
                want_even = torch.cat(
                    [make(q, (w * rows, 2), torch.float32, 3).chunk(w)[r] for q in range(w)]
                )
                if not (torch.equal(out, want) and torch.equal(got_even, want_even)):
                    bad.append((cma, rows))
    finally:
        _restore(comm)
    return possible, bad


@pytest.mark.parametrize("world", [2, 3])
def test_single_copy_all_to_all_matches_the_blocks(pools, world):
    res = pools.run(world, all_to_all_both_paths)
    assert [bad for _, bad in res] == [[]] * world
    if not all(possible for possible, _ in res):
        pytest.skip(NO_CMA)  # the copy path was checked; the single-copy one cannot run


@pytest.mark.parametrize("world", [2, 3, 4])
def test_single_copy_all_gather_matches_torch_and_the_copy_path(pools, world):
    res = pools.run(world, both_paths)
    assert [bad for _, bad in res] == [[]] * world
    if not all(possible for possible, _ in res):
        pytest.skip(NO_CMA)  # the copy path was checked; the single-copy one cannot run


ALGOS = ("one-shot", "two-shot", "single-copy")


def _algo(comm, algo: str) -> None:
    _testing.set_twoshot_min(comm, 0 if algo == "two-shot" else -1)
    _testing.set_cma_allreduce_min(comm, 0 if algo == "single-copy" else -1)


def all_reduce_by_every_algorithm(comm, threads=1):
    """all_reduce by single copy (every size), one-shot and two-shot: the same
    bits (one summation order), and the float64 sum of every rank's data; single
    copy takes its three rounds where the reads are on.  ``threads``: per rank,
    sharing every job of 4 KiB and more."""
    w = comm.world_size
    bad, used = [], True
    on = _testing.cma_init(comm, True, 0)[1] and comm.single_copy
    if threads > 1:
        _testing.set_threads(comm, threads, 4096)
    try:
        for n in (1, 33, 1000, 70_001, 600_000):
            for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
                for op in (tpcomm.ReduceOp.SUM, tpcomm.ReduceOp.MAX):
                    x = make(comm.rank, n, dt, n)
                    xs = torch.stack([make(q, n, dt, n).double() for q in range(w)])
                    ref = xs.sum(0) if op is tpcomm.ReduceOp.SUM else xs.max(0).values
                    got = {}
                    for algo in ALGOS:
                        _algo(comm, algo)
                        y = x.clone()
                        before = _testing.rounds(comm)
                        comm.all_reduce(y, op)
                        if algo == "single-copy" and on:
                            used &= _testing.rounds(comm) - before == 3
                        got[algo] = y
                    # the float sums round in rank order; float64 does not round
                    tol = {torch.float32: (1e-5, 1e-4), torch.int32: (0, 0)}.get(dt, (2e-2, 0.5))
                    if not (
                        torch.equal(got["one-shot"], got["two-shot"])
                        and torch.equal(got["one-shot"], got["single-copy"])
                    ):
                        bad.append(("bits", n, str(dt), op.name))
                    elif not torch.allclose(got["one-shot"].double(), ref, *tol):
                        bad.append(("reference", n, str(dt), op.name))
    finally:
        _restore(comm)
    return on and used, bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_single_copy_all_reduce_has_the_bits_of_the_other_algorithms(pools, world):
    res = pools.run(world, all_reduce_by_every_algorithm)
    assert [bad for _, bad in res] == [[]] * world
    if not all(used for used, _ in res):
        pytest.skip(NO_CMA)  # one-shot and two-shot were checked; single copy cannot run


def test_single_copy_all_reduce_split_between_threads_has_the_same_bits(pools):
    """Each rank's reads of its peers (and its reductions) split between 3
    threads: the same bits as every algorithm on one thread, and the float64 sum."""
    res = pools.run(2, all_reduce_by_every_algorithm, 3)
    assert [bad for _, bad in res] == [[]] * 2
    if not all(used for used, _ in res):
        pytest.skip(NO_CMA)


NO_CMA = (
    "this machine refuses process_vm_readv between the ranks (Yama ptrace_scope >= 1 or a "
    "seccomp profile): tpcomm uses the copy path, checked above"
)


def rank_1_refuses_single_copy(comm):
    st, on = _testing.cma_init(comm, comm.rank != 1, 0)
    x = make(comm.rank, 70_000, torch.float32, 5)
    got = comm.all_gather(x)
    _restore(comm)
    want = torch.cat([make(q, 70_000, torch.float32, 5) for q in (0, 1, 2)])
    return st, on, torch.equal(got, want)


def test_one_rank_without_single_copy_turns_it_off_for_every_rank(pools):
    assert pools.run(3, rank_1_refuses_single_copy) == [(0, False, True)] * 3


def _noop(comm):
    return comm.rank


def test_a_bad_tpcomm_cma_fails_creation_cleanly(monkeypatch):
    """Read before the segment exists: every rank raises, nothing is left
    (the leak check after every test), nobody waits for the others."""
    monkeypatch.setenv("TPCOMM_CMA", "yes")
    t0 = time.time()
    with pytest.raises(tpcomm.LaunchError, match="TPCOMM_CMA='yes': expected 0 or 1"):
        tpcomm.launch(_noop, 2, timeout=60)
    assert time.time() - t0 < 30


def test_tpcomm_cma_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("TPCOMM_CMA", "0")
    assert _env.cma() is False
    monkeypatch.setenv("TPCOMM_CMA", "yes")
    with pytest.raises(ValueError, match="TPCOMM_CMA='yes': expected 0 or 1"):
        _env.cma()
    monkeypatch.delenv("TPCOMM_CMA")
    assert _env.cma() is True
    assert _env.cma_min_bytes(2) == 4 << 20 and _env.cma_min_bytes(8) == -1
    monkeypatch.setenv("TPCOMM_CMA_MIN_BYTES", "0")
    assert _env.cma_min_bytes(8) == 0


def _single_copy(comm, which, x):
    """The collective under test, on the single-copy path (cma_init min 0)."""
    if which == "all_gather":
        return comm.all_gather(x)
    if which.startswith("all_reduce"):
        _testing.set_cma_allreduce_min(comm, 0)
        if which == "all_reduce, 2 threads":  # the reads split between them
            _testing.set_threads(comm, 2, 0)
        return comm.all_reduce(x)
    return comm.all_to_all_single(torch.empty_like(x), x)


def killed_while_read(comm, outdir, which):
    """Rank 1 dies while it waits for its peers to finish reading its input;
    rank 0 reads it only afterwards (the fault knob delays its reads 400 ms)."""
    r = comm.rank
    if not _testing.cma_init(comm, True, 0)[1]:
        return "no cma"
    x = torch.ones(3 << 18)
    if r == 0:
        _testing.fault_check_delay(comm, 400_000.0)
    if r == 1:

        def die():
            write_json(os.path.join(outdir, "killed"), time.time())
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.15, die).start()
    try:
        _single_copy(comm, which, x)
        res = "no error"
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.time()]
    write_json(os.path.join(outdir, f"rank{r}"), res)
    return res


SINGLE_COPY = ["all_gather", "all_to_all_single", "all_reduce", "all_reduce, 2 threads"]


@pytest.mark.parametrize("which", SINGLE_COPY)
def test_a_peer_killed_while_it_is_read(tmp_path, which):
    with LocalGroup(3, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        if g.run(killed_while_read, str(tmp_path), which, timeout=60) == ["no cma"] * 3:
            pytest.skip(NO_CMA)
    assert info.value.rank == 1
    assert_survivors_saw(tmp_path, 1, (0, 2))


def unreadable(comm, which):
    if not _testing.cma_init(comm, True, 0)[1]:
        return None, 0.0
    if comm.rank == 1:
        _testing.fault_cma_addr(comm, True)  # publishes an address nobody can read
    t0 = time.time()
    res = comm_error_of(lambda: _single_copy(comm, which, torch.ones(999)))
    return res, time.time() - t0


@pytest.mark.parametrize("which", SINGLE_COPY)
def test_a_refused_read_is_a_clear_error_on_every_rank(which):
    res = tpcomm.launch(unreadable, 3, args=(which,), timeout=60)
    if res[0][0] is None:
        pytest.skip(NO_CMA)
    for r, ((kind, msg), took) in enumerate(res):
        assert kind == "CommError" and took < 5.0, (r, msg)
        if r == 1:  # it read its peers fine, then saw who could not read it
            assert "could not read a peer's input" in msg and "TPCOMM_CMA=0" in msg
    # ranks 0 and 2 read rank 1 (or learn that the other one could not)
    readers = [msg for (_, msg), _ in res[::2]]
    assert any("process_vm_readv: Bad address" in m for m in readers), readers


# -- messages by reference: sendrecv and batches that also receive -----------

BIG = 600_000  # float32 elements: 2.4 MiB, more than a world-2 channel's ring (1 MiB)


def exchanges_by_reference(comm):
    """Every way a large message sent by a batch that also receives can be
    received, with the reads by reference on (threshold 0) and off, against the
    values each rank must get; then a wrong out= and the channel still in step."""
    r = comm.rank
    peer = 1 - r
    res = {}
    try:
        for cma in (True, False):
            on = _testing.cma_init(comm, cma, 0)[1]
            xs = [make(r, BIG, torch.float32, 1), make(r, (7, 3), torch.int64, 2)]
            xs.append(make(r, 70_001, torch.bfloat16, 3))
            want = [make(peer, BIG, torch.float32, 1), make(peer, (7, 3), torch.int64, 2)]
            want.append(make(peer, 70_001, torch.bfloat16, 3))
            outs = [torch.empty_like(t) for t in want]
            got = comm.sendrecv(xs, peer, peer, out=outs)  # one C call
            ok = all(g is o for g, o in zip(got, outs))
            ok &= all(torch.equal(o, w) for o, w in zip(outs, want))
            got = comm.sendrecv(xs, peer, peer)  # one C call, into new tensors
            ok &= all(torch.equal(g, w) for g, w in zip(got, want))
            # a transposed tensor: the C call declines, the general path (p2p_batch)
            (got,) = comm.sendrecv([xs[0].view(-1, 2).t()], peer, peer)
            ok &= torch.equal(got, want[0].view(-1, 2).t())
            # rank 0 exchanges, rank 1 receives with recv() (the blocking path:
            # into new tensors, then into out= in one C call) and sends by value
            for into in (None, torch.empty(BIG)):
                if r == 0:
                    (back,) = comm.sendrecv([xs[0]], 1, 1)
                    ok &= torch.equal(back, want[0] * 2)
                else:
                    (got1,) = comm.recv(0, out=None if into is None else [into])
                    ok &= torch.equal(got1, want[0]) and (into is None or got1 is into)
                    comm.send([xs[0] * 2], 0)
            try:
                comm.sendrecv([xs[0]], peer, peer, out=[torch.empty(BIG + 1)])
                res[f"wrong out {cma}"] = "no error"
            except ValueError as e:
                res[f"wrong out {cma}"] = str(e)
            (tail,) = comm.sendrecv([torch.full((3,), float(r))], peer, peer)
            ok &= tail.tolist() == [float(peer)] * 3
            res[cma] = (on, ok)
    finally:
        _restore(comm)
    return res


def test_large_exchanges_by_reference_match(pools):
    for res in pools.run(2, exchanges_by_reference):
        for cma in (True, False):
            err = res[f"wrong out {cma}"]
            assert "(600001,)" in err and "(600000,)" in err, err
        assert res[False] == (False, True)
        if not res[True][0]:
            pytest.skip(NO_CMA)
        assert res[True] == (True, True)


def refused_by_reference(comm, lone):
    """Rank 1 publishes an address nobody can read: an exchange (by reference)
    fails on both ranks; a lone send (by value) is not affected."""
    if not _testing.cma_init(comm, True, 0)[1]:
        return None
    if comm.rank == 1:
        _testing.fault_cma_addr(comm, True)
    x = torch.ones(BIG)

    def call():
        if lone:
            if comm.rank == 1:
                comm.send([x], 0)
            else:
                comm.recv(1, out=[torch.empty(BIG)])
        elif lone is None:  # a transposed tensor: the general path (p2p_batch)
            comm.sendrecv([x.view(-1, 2).t()], 1 - comm.rank, 1 - comm.rank)
        else:
            comm.sendrecv([x], 1 - comm.rank, 1 - comm.rank, out=[torch.empty(BIG)])

    return comm_error_of(call)


@pytest.mark.parametrize("lone", [False, None, True])
def test_a_refused_read_by_reference_fails_both_ranks(lone):
    res = tpcomm.launch(refused_by_reference, 2, args=(lone,), timeout=60)
    if res[0] is None:
        pytest.skip(NO_CMA)
    if lone:
        assert res == ["no error"] * 2
        return
    (k0, m0), (k1, m1) = res
    assert k0 == k1 == "CommError", res
    assert "process_vm_readv: Bad address" in m0 and "sendrecv" in m0, m0
    assert "could not read" in m1, m1


def killed_while_read_by_reference(comm, outdir):
    """Rank 1 dies while rank 0 reads its message (the fault knob delays each
    read 400 ms); rank 0 must raise PeerFailedError, not hang."""
    r = comm.rank
    if not _testing.cma_init(comm, True, 0)[1]:
        return "no cma"
    if r == 0:
        _testing.fault_check_delay(comm, 400_000.0)
    else:

        def die():
            write_json(os.path.join(outdir, "killed"), time.time())
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.15, die).start()
    try:
        comm.sendrecv([torch.ones(BIG)], 1 - r, 1 - r, out=[torch.empty(BIG)])
        res = "no error"
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.time()]
    write_json(os.path.join(outdir, f"rank{r}"), res)
    return res


def test_a_peer_killed_while_its_message_is_read(tmp_path):
    with LocalGroup(2, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        if g.run(killed_while_read_by_reference, str(tmp_path), timeout=60) == ["no cma"] * 2:
            pytest.skip(NO_CMA)
    assert info.value.rank == 1
    assert_survivors_saw(tmp_path, 1, (0,))

"""Communicator.empty: tensors in shared memory, and the zero-copy all_reduce.

Guards: results equal the torch reference and are bitwise equal across ranks; a
zero-copy all_reduce is three rounds (a round more a piece past the first, in
pieces from TPCOMM_CHUNK_MIN_BYTES) and copies nothing in; small ones take the
ordinary path; a tensor at an offset inside the buffer works; ranks disagreeing
on zero-copy get a mismatch error; the tensor outlives close(); nothing leaks.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

import tpcomm
from tpcomm import _testing
from tpcomm.shm.symmetric import MAX_LIVE

from ._helpers import BIG, zero_copy_matrix
from ._ref import make, reference


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_copy_all_reduce(pools, world):
    res = pools.run(world, zero_copy_matrix)
    problems = [p for ps, _ in res for p in ps]
    assert not problems, problems[:10]
    assert all(d == res[0][1] for _, d in res)


@pytest.mark.parametrize("world,chunk", [(2, 65536), (3, 12288)])
def test_zero_copy_in_pieces(pools, world, chunk):
    """From TPCOMM_CHUNK_MIN_BYTES zero copy goes chunk bytes of every shard
    at a time: a round a piece (counted independently), the same results as
    the references, bitwise equal across ranks, for sizes that are and are
    not a multiple of the piece, at offsets inside the buffer."""
    res = pools.run(world, zero_copy_matrix, chunk)
    problems = [p for ps, _ in res for p in ps]
    assert not problems, problems[:10]
    assert all(d == res[0][1] for _, d in res)
    whole = pools.run(world, zero_copy_matrix)
    assert whole[0][1] == res[0][1]  # the same bits as the whole shards at once


def disagree_on_pieces(comm):
    buf = comm.empty((BIG,), torch.float32).fill_(1.0)
    eng = _testing.engine(comm)
    eng.adjust(chunk_min=0 if comm.rank == 0 else -1, chunk_bytes=65536)
    try:
        comm.all_reduce(buf)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        _testing.restore(comm)


def test_ranks_cutting_zero_copy_differently_are_told(pools):
    for msg in pools.run(2, disagree_on_pieces):
        assert "mismatched collective" in msg and "in pieces of 64 KiB" in msg, msg


def counted_calls(comm, x, calls):
    """`calls` all_reduces of x, each rank's values rank + 1: each call's
    rounds, and whether every result was right."""
    total = float(sum(range(1, comm.world_size + 1)))
    rounds, right = [], True
    for _ in range(calls):
        x.fill_(comm.rank + 1.0)
        r0 = _testing.rounds(comm)
        comm.all_reduce(x)
        rounds.append(_testing.rounds(comm) - r0)
        right &= bool(torch.all(x == total))
    return rounds, right


def chosen_as_it_runs(comm, slow_us, calls):
    """Zero copy made slow on rank 0 (fault_zero_copy), then the copies
    (fault_stores): per phase, each call's rounds (3: zero copy; 2: the
    copies, two-shot), whether every result was right, and the choice in
    force at the end for this size (1: the copies)."""
    eng = _testing.engine(comm)
    _testing.set_zero_copy_auto(comm, False)
    _testing.set_zero_copy_auto(comm, True)  # from nothing learnt
    # the copies' stores chosen as they run, where fault_stores slows them (at
    # world 3 on 2 cores the ranks outnumber the cores, which turns that off)
    eng.adjust(twoshot_min=0, chunk_min=-1, zc_min=0, zc_max=-1, nt_auto=True)
    x = comm.empty((1 << 17,), torch.float32)  # 512 KiB
    out = []
    try:
        for zc_us, copies_us in ((slow_us, 0.0), (0.0, slow_us)):
            if comm.rank == 0:
                eng.fault_zero_copy(zc_us)
                eng.fault_stores(copies_us, copies_us)
            rounds, right = counted_calls(comm, x, calls)
            st = eng.zero_copy_state()
            out.append((rounds, right, st["copies"][1], st["trials"], st["jumps"]))
    finally:
        eng.fault_zero_copy(0.0)
        eng.fault_stores(0.0, 0.0)
        _testing.restore(comm)
    return out


def chooser_problem(res: list, world: int) -> str:
    """What, if anything, the chooser did that it should not have: "" when
    it turned the size to the copies and back, trying the other one as it
    should.  (That every rank ran the same rounds and every result was right
    is asserted apart: no busy machine excuses those.)"""
    (slow_zc, _, end1, trials1, jumps1), (slow_copies, _, end2, trials2, jumps2) = res[0]
    if not (end1 == 1 and end2 == 0):  # the copies, then zero copy again
        return f"ended on {end1}, {end2}"
    # after the change of mind, mostly the choice, a few calls trying the other
    # (turning back needs them: zero copy is timed again only when tried)
    if not (slow_zc[-100:].count(2) >= 80 and slow_copies[-100:].count(3) >= 80):
        return f"not mostly the choice: {slow_zc[-100:]} {slow_copies[-100:]}"
    if not (trials1 >= 2 and trials2 - trials1 >= 2):
        return f"trials {trials1}, {trials2}"
    if world == 2:
        # a trial is four calls in a row (asked for after one call, the
        # choice asked back after the third, which is the one timed: each
        # holds from the call after the next), every 128 calls of the choice,
        # or at once where the choice's cost jumped (the machine changed), the
        # next one 128 calls after that: a jump cuts one run short
        for phase, choice, jumps in ((slow_zc, 2, jumps1), (slow_copies, 3, jumps2 - jumps1)):
            runs = [(k, len(list(g))) for k, g in itertools.groupby(phase[-400:])]
            trials = [n for k, n in runs[1:-1] if k != choice]
            if not (len(trials) >= 2 and set(trials) == {4}):
                return f"trials not of four calls: {runs}"
            if sum(n < 100 for k, n in runs[1:-1] if k == choice) > jumps:
                return f"runs of the choice cut short, {jumps} jumps: {runs}"
    return ""


@pytest.mark.parametrize("world", [2, 3])
def test_zero_copy_or_the_copies_chosen_as_it_runs(pools, world):
    """Rank 0 times zero copy and the copies of a comm.empty tensor as calls
    run and keeps the cheaper for that size, every rank following it from the
    same call (no mismatch, the same rounds on every rank, every result
    right): zero copy made 300 us slower turns the size to the copies, and
    then the copies made slower turn it back.  Some calls try the other one.
    At world 3 the ranks outnumber the cores, and a call that loses its core
    for a time slice (1-4 ms) weighs more than 300 us: the slower one is
    2 ms slower there.  A busy machine switches now and then of itself (a
    noise switch lasts a period): the chooser's behaviour may take up to
    three runs, from nothing learnt, to show without one."""
    slow = 300.0 if world == 2 else 2000.0
    problems = []
    for _attempt in range(3):
        res = pools.run(world, chosen_as_it_runs, slow, 800, timeout=300)
        same = [[phase[:3] for phase in r] for r in res]
        assert all(r == same[0] for r in same), "ranks ran different rounds"
        (slow_zc, right1, *_), (slow_copies, right2, *_) = res[0]
        assert right1 and right2
        assert set(slow_zc) | set(slow_copies) <= {2, 3}
        problems.append(chooser_problem(res, world))
        if not problems[-1]:
            return
    pytest.fail("\n".join(problems))


def rank0_says(comm, flag: bool) -> bool:
    """Rank 0's flag, on every rank (a collective)."""
    t = torch.tensor([float(flag)])
    comm.broadcast(t, 0)
    return t.item() != 0.0


def reacts_at_once(comm, slow_us):
    """The copies kept 300 us slower throughout (zero copy the choice); zero
    copy made slow_us slower for one call in 17, sixteen times (a one-off on
    every phase of the one-in-16 timing), then for every call: each phase's
    rounds (3: zero copy; 2: the copies, two-shot), whether every result was
    right, and rank 0's jumps and choice for this size (1: the copies) after
    each of the last two phases.  A busy machine makes calls slow of itself,
    three in a row now and then (a jump or a switch that no one-off made),
    for a second or so at a time: the one-off phase, from nothing learnt, is
    run up to five times, a second apart, until one keeps zero copy with no
    jump."""
    eng = _testing.engine(comm)
    eng.adjust(twoshot_min=0, chunk_min=-1, zc_min=0, zc_max=-1, nt_auto=True)
    x = comm.empty((1 << 17,), torch.float32)  # 512 KiB
    b = 1  # its bucket: one per power of two from 256 KiB
    out, right = [], True
    try:
        if comm.rank == 0:
            eng.fault_stores(300.0, 300.0)
        for attempt in range(5):
            if attempt:
                time.sleep(1.0)  # past a burst of the machine's own slowness
            _testing.set_zero_copy_auto(comm, False)
            _testing.set_zero_copy_auto(comm, True)  # from nothing learnt
            rounds, ok = counted_calls(comm, x, 300)
            right &= ok
            one_off = []
            for k in range(16):
                for j in range(17):
                    if comm.rank == 0:
                        eng.fault_zero_copy(slow_us if j == k else 0.0)
                    rounds, ok = counted_calls(comm, x, 1)
                    one_off += rounds
                    right &= ok
            st = eng.zero_copy_state()
            # zero copy throughout, a trial aside, and no jump: rank 0 tells
            bad = rank0_says(comm, st["jumps"] > 0 or one_off.count(3) < len(one_off) - 8)
            if not bad:
                break
        out.append((one_off, st["jumps"], st["copies"][b]))
        if comm.rank == 0:
            eng.fault_zero_copy(slow_us)
        rounds, ok = counted_calls(comm, x, 100)
        right &= ok
        st = eng.zero_copy_state()
        out.append((rounds, st["jumps"], st["copies"][b]))
    finally:
        eng.fault_zero_copy(0.0)
        eng.fault_stores(0.0, 0.0)
        _testing.restore(comm)
    return out, right


def test_a_change_of_the_machine_is_seen_at_once(pools):
    """A timed call of the choice over twice its cost has the second and
    third calls after it timed; three in a row are the machine changing (this VM's slow mode made
    zero copy 11x slower from one call to the next, the copies 2x): the new
    cost holds at once and the size turns within a few calls, where the
    capped average took about 100. A one-off slow call changes nothing."""
    res = pools.run(2, reacts_at_once, 3000.0, timeout=300)
    assert res[0][1] and res[1][1], "a wrong result"
    (one_off, jumps1, choice1), (rounds, jumps2, choice2) = res[0][0]
    assert [r[0] for r in res[1][0]] == [one_off, rounds], "ranks ran different rounds"
    assert jumps1 == 0 and choice1 == 0, (jumps1, one_off)
    assert one_off.count(3) >= len(one_off) - 8, one_off  # zero copy, a trial aside
    assert jumps2 >= 1 and choice2 == 1
    runs = [(k, len(list(g))) for k, g in itertools.groupby(rounds)]
    first = next(i for i, (k, n) in enumerate(runs) if k == 2 and n >= 8)
    assert sum(n for _, n in runs[:first]) <= 40, runs


def learning_afresh(comm):
    """Every rank: all_reduce two-shot from 0 bytes, comm.empty tensors zero
    copy from 0 bytes, the stores from plain and rank 0's choice of zero copy
    or the copies from nothing learnt (a barrier); the engine."""
    eng = _testing.engine(comm)
    eng.adjust(nt_auto=False)  # the stores from plain, nothing learnt
    eng.adjust(twoshot_min=0, chunk_min=-1, zc_min=0, zc_max=-1, nt_auto=True)
    _testing.set_zero_copy_auto(comm, False)
    _testing.set_zero_copy_auto(comm, True)
    return eng


def chosen_stores(eng):
    """Each size's stores as rank 0 chose them (1: non-temporal): the bits in
    use, but the kind it had where a probation tries the other one."""
    st = eng.stores()
    return [nt ^ (b in st["trying"]) for b, nt in enumerate(st["nt"])]


def with_slow_stores(comm, calls, zc_us, plain_us, nt_us):
    """Zero copy made zc_us slower on rank 0 and the copies slower by
    plain_us on plain stores, nt_us on non-temporal ones, the stores starting
    plain: each call's rounds (3: zero copy; 2: the copies, two-shot),
    whether every result was right, the choice at the end for this size (1:
    the copies), the stores chosen (1: non-temporal) and rank 0's costs for
    the size (zero copy, the copies on plain stores, on non-temporal ones)."""
    eng = learning_afresh(comm)
    x = comm.empty((1 << 17,), torch.float32)
    try:
        if comm.rank == 0:
            eng.fault_zero_copy(zc_us)
            eng.fault_stores(plain_us, nt_us)
        rounds, right = counted_calls(comm, x, calls)
        st = eng.zero_copy_state()
        return rounds, right, st["copies"][1], chosen_stores(eng), st["cost"][1]
    finally:
        eng.fault_zero_copy(0.0)
        eng.fault_stores(0.0, 0.0)
        _testing.restore(comm)


def test_a_trial_of_the_copies_runs_them_on_non_temporal_stores(pools):
    """A size whose copies never ran keeps the stores it started with, plain;
    where those make the copies lose and non-temporal ones make them win
    (this VM's slow mode), the copies must be tried on the latter, or zero
    copy is kept at twice their cost.  Here zero copy is 3 ms slower and the
    copies 6 ms slower on plain stores only (more than a VM's pause): the
    first trials turn the size to the copies, which keep their non-temporal
    stores."""
    res = pools.run(2, with_slow_stores, 800, 3000.0, 6000.0, 0.0, timeout=300)
    assert res[0][:3] == res[1][:3], "ranks ran different rounds"
    rounds, right, copies, nt, _ = res[0]
    assert right and copies == 1
    assert rounds[-100:].count(2) >= 95, rounds
    assert any(nt[len(nt) // 2 :]), nt  # a two-shot size on non-temporal stores


def test_a_trial_of_the_copies_also_runs_them_on_plain_stores(pools):
    """Where the machine is fast, non-temporal stores make the copies of a
    size that fits the caches slow (4x at 256 KiB on AMD Zen 4), and trials
    on those alone kept zero copy at twice the copies' cost for 1700 calls.
    The first trial runs the copies on the stores as they stand (plain here),
    and the kinds take turns after: with non-temporal stores 6 ms slower and
    zero copy 3 ms slower, the size turns to the copies at a trial on
    plain stores (the first after its 16th call, unless a slow moment of the
    machine fell on its timed call: then the third), and its stores stay
    plain."""
    res = pools.run(2, with_slow_stores, 400, 3000.0, 0.0, 6000.0, timeout=300)
    assert res[0][:3] == res[1][:3], "ranks ran different rounds"
    rounds, right, copies, nt, cost = res[0]
    assert right and copies == 1, (rounds, cost)
    assert rounds[-100:].count(2) >= 94, rounds  # the copies, a zero-copy trial aside
    assert 16 <= rounds.index(2) <= 20, rounds  # the first trial, on plain stores
    assert cost[0] > 0 and cost[1] > 0 and (cost[2] == 0 or cost[2] > cost[1]), cost
    assert not any(nt), nt


def turns_slow(comm):
    """Zero copy kept (the copies made 40 ms slower on both stores) for 200
    calls, so its trials have tried both stores, the last non-temporal, and
    what they learnt of both loses to zero copy after the change; then the
    machine "turns slow": zero copy 20 ms slower, the copies 40 ms slower on
    plain stores, not at all on non-temporal ones (more than a VM's pause).  Each call's rounds in
    the second phase, whether every result was right, the choice at the end
    (1: the copies) and the stores chosen."""
    eng = learning_afresh(comm)
    x = comm.empty((1 << 17,), torch.float32)
    try:
        if comm.rank == 0:
            eng.fault_stores(40000.0, 40000.0)
        _, right = counted_calls(comm, x, 200)
        if comm.rank == 0:
            eng.fault_zero_copy(20000.0)
            eng.fault_stores(40000.0, 0.0)
        rounds, ok = counted_calls(comm, x, 80)
        state = eng.zero_copy_state()["copies"][1], chosen_stores(eng)
    finally:
        eng.fault_zero_copy(0.0)
        eng.fault_stores(0.0, 0.0)
        _testing.restore(comm)
    return rounds, right and ok, *state


def test_a_jump_of_zero_copy_tries_the_copies_non_temporal(pools):
    """A jump of zero copy's cost (three slow calls in a row) is the machine
    turning slow, where the copies need non-temporal stores: the trial it
    asks for at once runs them so, whichever kind the turns would have tried,
    and the size turns to the copies within a few calls, not a period of 128
    calls later."""
    res = pools.run(2, turns_slow, timeout=300)
    assert res[0][:3] == res[1][:3], "ranks ran different rounds"
    rounds, right, copies, nt = res[0]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(rounds)]
    assert right and copies == 1, runs
    first = next(i for i, (k, n) in enumerate(runs) if k == 2 and n >= 8)
    assert sum(n for _, n in runs[:first]) <= 40, runs
    assert any(nt[len(nt) // 2 :]), nt  # a two-shot size on non-temporal stores


def trial_lengths(comm, elements):
    """The copies made slow on rank 0 (both stores), so zero copy stays: the
    lengths of the runs of calls that copied (2 rounds: two-shot), one per
    trial, over 300 calls of a comm.empty tensor of `elements` float32."""
    eng = learning_afresh(comm)
    x = comm.empty((elements,), torch.float32)
    try:
        if comm.rank == 0:
            eng.fault_stores(2000.0, 2000.0)
        rounds, right = counted_calls(comm, x, 300)
    finally:
        eng.fault_stores(0.0, 0.0)
        _testing.restore(comm)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(rounds)]
    return [n for k, n in runs if k == 2], right


def test_a_trial_is_timed_once_its_copies_went_round_the_slot(pools):
    """A trial times the third call of the copies, or the first after their
    copies have gone once round their places in the slots (a 1 MiB slot: four
    places of 256 KiB, two of 512 KiB): until then their stores meet lines
    the peers read recently, and the copies looked 2.5-3x their steady cost.
    So a trial is a call longer than its timed one (the one that starts
    before the choice is back): six calls at 256 KiB, four at 512 KiB."""
    for elements, want in ((1 << 16, 6), (1 << 17, 4)):
        res = pools.run(2, trial_lengths, elements, timeout=300)
        assert res[0] == res[1], "ranks ran different rounds"
        runs, right = res[0]
        # trials after the 16th, 128th and 256th calls, and any that a slow
        # moment of the machine asked for at once (a jump); one a call longer
        # where the call to time fell on the stores' own trial of the other
        # kind (2 rounds in 256), which tells nothing of either way
        assert right and len(runs) >= 3 and set(runs) <= {want, want + 1}, (elements, runs)
        assert runs.count(want) >= len(runs) - 1, (elements, runs)


def disagree(comm):
    buf = comm.empty((BIG,), torch.float32)
    x = buf if comm.rank == 0 else torch.empty(BIG)
    x.fill_(1.0)
    try:
        comm.all_reduce(x)
        return "no error"
    except ValueError as e:
        return str(e)


def test_ranks_disagreeing_on_zero_copy(pools):
    for msg in pools.run(2, disagree):  # rank 0 reads in place, or copies as chosen
        assert "mismatched collective" in msg, msg
        assert "zero-copy" in msg or "copying a comm.empty tensor" in msg, msg


def by_its_switch_point(comm):
    """(rounds, equal to the reference) of a 256 KiB float32 all_reduce of a
    comm.empty tensor under (zero-copy point, two-shot point) settings, and
    the error when the ranks' zero-copy points differ."""
    eng = _testing.engine(comm)
    n, w = 65536, comm.world_size
    x = comm.empty((n,), torch.float32)
    ref = reference([make(q, n, torch.float32, 5) for q in range(w)], tpcomm.ReduceOp.SUM)
    out = []
    _testing.set_zero_copy_auto(comm, False)  # rounds counted
    cases = ((-1, -1, -1), (0, -1, -1), (0, -1, 0), (n * 4 + 1, -1, 0), (0, n * 4 - 1, 0))
    for zc, top, two in cases:
        eng.adjust(zc_min=zc, zc_max=top, twoshot_min=two)
        x.copy_(make(comm.rank, n, torch.float32, 5))
        r0 = _testing.rounds(comm)
        comm.all_reduce(x)
        out.append((_testing.rounds(comm) - r0, torch.equal(x, ref)))
    eng.adjust(zc_min=0 if comm.rank == 0 else -1, zc_max=-1, twoshot_min=-1)
    try:
        comm.all_reduce(x)
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    eng.restore()
    return out, msg


def test_zero_copy_has_its_own_switch_point(pools):
    """Zero-copy from TPCOMM_ZERO_COPY_MIN_BYTES up to _MAX_BYTES whatever
    algorithm plain tensors use (a profile that keeps plain tensors one-shot
    at every size kept comm.empty tensors from zero copy once); outside, or
    at -1, the copying algorithm in force."""
    for out, msg in pools.run(2, by_its_switch_point):
        # never: one-shot (1 round); from 0: zero-copy (3 rounds) beside one-shot or
        # two-shot plain tensors; below the window or past its top: two-shot (2 rounds)
        assert out == [(1, True), (3, True), (3, True), (2, True), (2, True)], out
        assert "mismatched collective" in msg and "zero-copy" in msg and "one-shot" in msg, msg


def ordinary_use(comm):
    t = comm.empty((3, 4), torch.int32)
    t.fill_(comm.rank)
    g = comm.all_gather(t)  # an ordinary tensor for everything else
    c2_shape = tuple(t.shape)
    return g.sum().item(), c2_shape, t.is_contiguous()


def test_empty_tensors_are_ordinary_tensors(pools):
    for total, shape, contiguous in pools.run(3, ordinary_use):
        assert total == 12 * (0 + 1 + 2) and shape == (3, 4) and contiguous


def bad_empty(comm):
    out = []
    for args, exc in (((-1,), ValueError), (("x",), ValueError), (((2,), "float"), TypeError)):
        try:
            comm.empty(*args)
            out.append(f"{args}: no error")
        except exc as e:
            if "empty:" not in str(e):
                out.append(str(e))
    z = comm.empty((0, 5))
    return out, tuple(z.shape)


def test_empty_arguments(pools):
    for problems, shape in pools.run(2, bad_empty):
        assert problems == [] and shape == (0, 5)


def close_then_read(comm):
    t = comm.empty((1000,), torch.float32)
    t.fill_(comm.rank + 1.0)
    comm.all_reduce(t)
    comm.close()
    return float(t.sum())  # still mapped: the tensor keeps its memory alive


def test_tensor_outlives_close():
    assert tpcomm.launch(close_then_read, 2, timeout=60) == [3000.0, 3000.0]


def empty_when_one_rank_has_no_room(comm, bad):
    """Rank ``bad`` cannot create its file (the shm directory is full): every rank
    raises the same CommError, nothing is left behind, and the communicator
    still works (empty() included)."""
    from tpcomm.errors import CommError
    from tpcomm.shm import segment

    real = segment.create

    def full(*args, **kwargs):
        raise CommError("tpcomm: the shared-memory directory has no room (simulated)")

    if comm.rank == bad:
        segment.create = full
    try:
        comm.empty((1000,))
        err = "no error"
    except tpcomm.CommError as e:
        err = str(e)
    finally:
        segment.create = real
    t = comm.empty((1000,))
    t.fill_(comm.rank + 1)
    comm.all_reduce(t)
    return err, t[:3].tolist()


@pytest.mark.parametrize("world,bad", [(2, 1), (3, 0)])
def test_empty_fails_together_when_a_rank_has_no_room(pools, world, bad):
    res = pools.run(world, empty_when_one_rank_has_no_room, bad)
    total = float(sum(range(1, world + 1)))
    for err, head in res:
        assert err.startswith(f"empty: rank {bad} could not create its shared buffer"), err
        assert "no room (simulated)" in err
        assert head == [total] * 3


def _sym_mappings() -> int:
    """This process's mappings of symmetric-buffer files."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "-sym-" in line and "tpcomm-" in line)


def _shm_used(directory: str) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def buffers_come_back(comm):
    """Three times as many 1 MiB buffers as may live at once, each used in a
    zero-copy all_reduce and dropped: no error, the mappings and the shm
    directory's space come back."""
    directory = os.environ["TPCOMM_SHM_DIR"]
    w, n = comm.world_size, (1 << 20) // 4
    _testing.set_zero_copy_auto(comm, False)  # zero copy, counted by its rounds
    used0, maps0 = _shm_used(directory), _sym_mappings()
    wrong = []
    for i in range(3 * MAX_LIVE):
        t = comm.empty((n,), torch.float32)
        t.fill_(float(comm.rank + i))
        r0 = _testing.rounds(comm)
        comm.all_reduce(t)
        if _testing.rounds(comm) - r0 != 3 or t[-1].item() != float(sum(range(w)) + w * i):
            wrong.append(i)
        del t
    held = _testing.symmetric_buffers(comm)
    maps = _sym_mappings() - maps0
    comm.barrier()  # every rank dropped every tensor
    grown = _shm_used(directory) - used0
    _testing.restore(comm)
    return wrong, held, maps, grown


def test_buffers_whose_tensors_are_gone_are_reclaimed(pools, monkeypatch):
    """The space is measured on a tmpfs of the test's own (the whole of /dev/shm
    also holds what other processes do meanwhile); where none can be mounted,
    the mappings and the engine's list are still checked, the space is not."""
    import subprocess

    from ._helpers import mount_tiny_tmpfs

    try:
        own = mount_tiny_tmpfs("512m")
    except pytest.skip.Exception:
        own = None
    try:
        if own is not None:
            monkeypatch.setenv("TPCOMM_SHM_DIR", own)  # the ranks read it at each call
        for wrong, held, maps, grown in pools.run(2, buffers_come_back):
            assert wrong == []
            assert held == (0, 0) and maps == 0
            # 3 x 64 x 1 MiB x 2 ranks were made: without reclaiming, 384 MiB
            if own is not None:
                assert grown < 8 << 20, grown
    finally:
        if own is not None:
            # lazily: a rank may still hold a descriptor of the directory's
            subprocess.run(["umount", "-l", own], check=False)
            os.rmdir(own)


def live_limit(comm):
    """As many buffers as may live, then one more: the same CommError on every
    rank; dropping one makes room, and the communicator works throughout."""
    keep = [comm.empty((1024,), torch.float32) for _ in range(MAX_LIVE)]
    try:
        comm.empty((1024,))
        err = "no error"
    except tpcomm.CommError as e:
        err = str(e)
    keep.pop()
    t = comm.empty((BIG,), torch.float32)
    t.fill_(comm.rank + 1.0)
    comm.all_reduce(t)
    return err, t[0].item(), _testing.symmetric_buffers(comm)


def test_live_buffer_limit_is_an_error_on_every_rank(pools):
    for err, first, held in pools.run(2, live_limit):
        assert err.startswith("empty: rank 0 could not create its shared buffer"), err
        assert f"{MAX_LIVE} live buffers" in err and "(and 1 more ranks)" in err
        assert first == 3.0 and held == (MAX_LIVE, MAX_LIVE)


def dropped_apart(comm):
    """Ranks drop their tensors at different times, one while another thread is
    inside a call: later buffers still pair up rank by rank (zero-copy
    results right), and what was deferred goes at the next empty()."""
    import threading
    import time

    _testing.set_zero_copy_auto(comm, False)  # zero copy, counted by its rounds
    a = comm.empty((BIG,), torch.float32)
    b = comm.empty((BIG,), torch.float32)
    deferred = None
    if comm.rank == 0:
        del a  # rank 1 keeps its a
        # a call inside the engine (waiting for rank 1) when b's tensor goes
        th = threading.Thread(target=comm.barrier)
        th.start()
        time.sleep(0.3)
        del b
        deferred = _testing.symmetric_buffers(comm)
        th.join()
    else:
        time.sleep(0.8)
        comm.barrier()
        del b
    c = comm.empty((BIG,), torch.float32)
    c.fill_(comm.rank + 2.0)
    r0 = _testing.rounds(comm)
    comm.all_reduce(c)
    rounds = _testing.rounds(comm) - r0
    _testing.restore(comm)
    return deferred, rounds, c[7].item(), _testing.symmetric_buffers(comm)


def test_ranks_may_drop_buffers_at_different_times(pools):
    (deferred, rounds0, v0, held0), (_, rounds1, v1, held1) = pools.run(2, dropped_apart)
    assert deferred == (1, 1)  # a went; b waits: another thread was inside a call
    assert rounds0 == rounds1 == 3 and v0 == v1 == 5.0
    assert held0 == (1, 1) and held1 == (2, 2)  # rank 1 still holds its a

"""The copies of an all_reduce chunk into the slots choose plain or
non-temporal stores as they run (_native/allreduce.c): the kind that costs
rank 0 less takes over on every rank, one-shot and two-shot apart, the results
are the float64 sum whichever kind runs, and an explicit TPCOMM_NT_MIN_BYTES
turns the choice off."""

from __future__ import annotations

import os

import pytest
import torch

import tpcomm
from tpcomm import _testing
from tpcomm.construction import engine_of
from tpcomm.launch import LocalGroup

from ._ref import make, reference

NT_KERNELS = any(isa in _testing.isa_variants() for isa in ("avx2", "avx512"))
BUCKET = 2  # one-shot 16 KiB: buckets are powers of two from 4 KiB
SIZES = 9  # buckets per algorithm: then two-shot's
EXPLORE = 256  # rounds between two chunks of the other kind


def calls_until_settled(
    comm, plain_us, nt_us, algo="one-shot", dtype=torch.float32, leftover=(0.0, 0)
):
    """Slow one kind down by the fault knob (and the first leftover[1] plain
    chunks after non-temporal ones by leftover[0] us), run all_reduces of 16
    KiB of dtype by algo until every rank took the other kind (at most 8
    exploring periods); the kind in use then, the wrong results, the calls it
    took, and the stores the engine names for that size."""
    _testing.set_twoshot_min(comm, -1 if algo == "one-shot" else 0)
    bucket = BUCKET + (SIZES if algo == "two-shot" else 0)
    _testing.fault_stores(comm, plain_us, nt_us, *leftover)
    want = 1 if plain_us > nt_us else 0
    n = 16384 // dtype.itemsize
    xs = [make(r, n, dtype, 3).double() for r in range(comm.world_size)]
    ref = sum(xs)
    wrong, calls = 0, 0
    try:
        for calls in range(1, 8 * EXPLORE + 1):
            x = make(comm.rank, n, dtype, 3)
            comm.all_reduce(x)
            if calls % 97 == 0:  # a sample of the results, against float64
                if dtype == torch.float32:
                    wrong += not torch.allclose(x.double(), ref, 1e-5, 1e-4)
                else:  # two values summed in float32, rounded once
                    wrong += not torch.equal(x, ref.to(dtype))
            state = _testing.stores(comm)
            done = state["nt"][bucket] == want and bucket not in state["trying"]
            # the ranks decide apart: stop together, once every rank chose
            if calls % 64 == 0:
                flag = torch.tensor([0 if done else 1])
                comm.all_reduce(flag)
                if flag.item() == 0:
                    break
        named = engine_of(comm).stores_in_use(16384, dtype)  # what tpcomm perf says
    finally:
        _testing.fault_stores(comm, 0, 0)
        _testing.set_twoshot_min(comm, None)
    return _testing.stores(comm)["nt"][bucket], wrong, calls, named


def both_ways(comm, algo):
    state = _testing.stores(comm)
    first = calls_until_settled(comm, 40.0, 0.0, algo)  # plain made slow: non-temporal wins
    back = calls_until_settled(comm, 0.0, 40.0, algo)  # and back
    return state, first, back, _testing.stores(comm)


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
@pytest.mark.parametrize("algo", ["one-shot", "two-shot"])
def test_the_cheaper_stores_take_over_on_every_rank(algo):
    bucket = BUCKET + (SIZES if algo == "two-shot" else 0)
    with LocalGroup(2, timeout=120) as g:
        res = g.run(both_ways, algo, timeout=300)
    for r, (state, first, back, after) in enumerate(res):
        assert state["on"] and state["nt"] == [0] * 2 * SIZES and state["switches"] == 0
        assert state["sizes"] == SIZES and state["min_bytes"] == 4096
        assert first[:2] == (1, 0), first  # non-temporal, no wrong result
        assert back[:2] == (0, 0), back  # plain again
        assert (first[3], back[3]) == ("nt", "plain")
        assert after["switches"] >= 2  # rank 0 chose, every rank followed
        plain, nt = after["cost"][bucket]
        if r == 0:  # it times the chunks; the others take its choice
            assert plain > 0 and nt > 0  # both kinds were timed
        else:
            assert (plain, nt) == (0.0, 0.0)
        other = BUCKET + SIZES - bucket  # the other algorithm's 16 KiB
        assert after["cost"][other] == (0.0, 0.0) and after["nt"][other] == 0


def leftovers(comm):
    """Non-temporal stores chosen (plain made slow); then non-temporal ones
    cost 10 us more a chunk and plain ones nothing once settled, but 12 us
    more on each of their first 4 chunks after non-temporal ones: what the
    lines non-temporal stores sent to memory cost the plain stores after
    them, and all a trial's second chunk sees of plain stores."""
    first = calls_until_settled(comm, 40.0, 0.0)
    before = _testing.stores(comm)
    back = calls_until_settled(comm, 0.0, 10.0, leftover=(12.0, 4))
    return first, before, back, _testing.stores(comm)


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
def test_plain_stores_that_pay_for_leftovers_on_trial_still_take_back_over():
    """A trial of plain stores after non-temporal ones costs more than plain
    stores do once settled (1 MiB on AMD Zen 4: 2.1-2.8x), about what the
    non-temporal ones cost: alone it would never switch back.  A probation
    runs them long enough to see their steady cost, and keeps them."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(leftovers, timeout=300)
    for r, (first, before, back, after) in enumerate(res):
        assert first[:2] == (1, 0), first
        assert back[:2] == (0, 0), back  # plain again, results right
        assert back[3] == "plain"
        if r == 0:  # rank 0 put each kind on probation and kept it
            assert after["probations"] > before["probations"] >= 1
            assert after["kept"] > before["kept"] >= 1
            assert after["trying"] == []
            plain, nt = after["cost"][BUCKET]
            assert plain < 0.9 * nt  # plain's cost is its settled one
        else:
            assert after["probations"] == after["kept"] == 0


def failed_probations(comm, periods):
    """Non-temporal stores chosen (plain made slow) and kept that way for
    `periods` exploring periods more: how many probations of plain stores
    rank 0 ran in them, and the kind in use after."""
    first = calls_until_settled(comm, 40.0, 0.0)
    _testing.set_twoshot_min(comm, -1)
    _testing.fault_stores(comm, 40.0, 0.0)
    try:
        before = _testing.stores(comm)["probations"]
        x = torch.ones(4096)
        for _ in range(periods * EXPLORE):
            comm.all_reduce(x.fill_(1))
        state = _testing.stores(comm)
    finally:
        _testing.fault_stores(comm, 0.0, 0.0)
        _testing.set_twoshot_min(comm, None)
    return first, state["probations"] - before, state["nt"][BUCKET], x.tolist() == [2.0] * 4096


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
def test_failed_probations_of_plain_stores_come_ever_more_rarely():
    """Where non-temporal stores do cost less, each probation of plain ones
    fails and doubles the trials before the next (1, 2, 4 ... 128): in 40
    exploring periods about 5 probations, not 40."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(failed_probations, 40, timeout=300)
    for r, (first, probations, nt, ok) in enumerate(res):
        assert first[:2] == (1, 0), first
        assert nt == 1 and ok
        if r == 0:
            assert 3 <= probations <= 6, probations
        else:
            assert probations == 0


def probation_left_alone(comm):
    """bfloat16 calls with plain stores made slow until rank 0's probation
    runs non-temporal stores; then only float32 calls of the same size: the
    choice, the probation and the results after 70 of them."""
    _testing.set_twoshot_min(comm, -1)
    _testing.fault_stores(comm, 40.0, 0.0)
    n = 16384 // 2
    try:
        for _ in range(4 * EXPLORE):
            comm.all_reduce(torch.ones(n, dtype=torch.bfloat16))
            flag = torch.tensor([int(BUCKET in _testing.stores(comm)["trying"])])
            comm.broadcast(flag, 0)
            if flag.item():
                break
        during = _testing.stores(comm), engine_of(comm).stores_in_use(16384, torch.float32)
        _testing.fault_stores(comm, 0.0, 0.0)
        x = torch.ones(4096)
        for _ in range(70):
            comm.all_reduce(x.fill_(1))
        after = _testing.stores(comm), engine_of(comm).stores_in_use(16384, torch.float32)
    finally:
        _testing.fault_stores(comm, 0.0, 0.0)
        _testing.set_twoshot_min(comm, None)
    return during, after, x.tolist() == [2.0] * 4096


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
def test_a_probation_whose_class_stops_coming_is_dropped():
    """A probation times its own reduce class's chunks only.  Where they stop
    coming, the other class's chunks would run its trial kind for good,
    untimed: after 64 of them it is dropped, the choice as it was."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(probation_left_alone, timeout=300)
    for r, ((during, named), (after, named_after), ok) in enumerate(res):
        assert ok
        assert named == "nt"  # the probation's trial kind, on every rank
        assert named_after == "plain"  # as before it
        if r == 0:
            assert during["trying"] == [BUCKET] and after["trying"] == []
            assert after["kept"] == during["kept"]


def two_classes(comm):
    """bfloat16 calls with plain stores made slow, then float32 calls: what
    each taught rank 0."""
    first = calls_until_settled(comm, 40.0, 0.0, dtype=torch.bfloat16)
    after16 = _testing.stores(comm)
    x = torch.ones(4096)
    for _ in range(3 * EXPLORE):
        comm.all_reduce(x.fill_(1))
    return first, after16, _testing.stores(comm), x.tolist() == [2.0] * 4096


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
def test_the_16_bit_floats_keep_costs_of_their_own():
    """Their reduce costs more a byte, so a trial of one kind on a float32
    chunk against the other kind's average of bfloat16 chunks would flip the
    choice for no change of the machine: rank 0 keeps their costs apart, and
    each class decides on its own (the choice itself is one per size)."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(two_classes, timeout=300)
    for r, (first, after16, after, ok) in enumerate(res):
        assert first[:2] == (1, 0), first  # bfloat16 alone chose non-temporal
        assert ok
        if r == 0:
            assert all(c > 0 for c in after16["cost16"][BUCKET])  # both kinds timed
            assert after16["cost"][BUCKET] == (0.0, 0.0)  # float32's untouched
            # float32 timed its own (without the fault it may choose plain
            # again), and left the 16-bit floats' costs as they were
            assert any(c > 0 for c in after["cost"][BUCKET])
            assert after["cost16"][BUCKET] == after16["cost16"][BUCKET]
        else:  # the others time nothing
            assert after["cost"][BUCKET] == after["cost16"][BUCKET] == (0.0, 0.0)


def stores_state(comm):
    x = torch.ones(4096)
    for _ in range(3 * EXPLORE):
        comm.all_reduce(x.fill_(1))
    named = engine_of(comm).stores_in_use(16384, torch.float32)
    return _testing.stores(comm), x.tolist() == [float(comm.world_size)] * 4096, named


@pytest.mark.parametrize("setting", ["-1", "0", "auto"])
def test_an_explicit_setting_fixes_the_stores(monkeypatch, setting):
    monkeypatch.setenv("TPCOMM_NT_MIN_BYTES", setting)
    with LocalGroup(2, timeout=60) as g:
        res = g.run(stores_state, timeout=120)
    for r, (state, ok, named) in enumerate(res):
        assert ok
        assert state["on"] is (setting == "auto" and NT_KERNELS)
        assert state["nt_copies"] is NT_KERNELS
        if setting != "auto":  # fixed: non-temporal from 0 bytes where they exist
            assert named == ("nt" if setting == "0" and NT_KERNELS else "plain")
        if not state["on"]:
            assert state["switches"] == 0 and state["cost"][BUCKET] == (0.0, 0.0)
        elif r == 0:
            assert state["cost"][BUCKET][0] > 0  # its 16 KiB calls were timed


def test_scalar_kernels_leave_the_choice_off(monkeypatch):
    monkeypatch.setenv("TPCOMM_ISA", "scalar")
    with LocalGroup(2, timeout=60) as g:
        res = g.run(stores_state, timeout=120)
    assert [(state["on"], ok, named) for state, ok, named in res] == [(False, True, "plain")] * 2


def test_tpcomm_nt_min_bytes_is_read_and_checked(monkeypatch):
    from tpcomm import _env

    monkeypatch.delenv("TPCOMM_NT_MIN_BYTES", raising=False)
    assert _env.nt_auto() and _env.nt_min_bytes() == -1
    monkeypatch.setenv("TPCOMM_NT_MIN_BYTES", "65536")
    assert not _env.nt_auto() and _env.nt_min_bytes() == 65536
    monkeypatch.setenv("TPCOMM_NT_MIN_BYTES", "sometimes")
    with pytest.raises(ValueError, match="TPCOMM_NT_MIN_BYTES='sometimes'"):
        _env.nt_min_bytes()
    with pytest.raises(tpcomm.LaunchError, match="TPCOMM_NT_MIN_BYTES"):
        tpcomm.launch(_rank, 2, timeout=60)


def _rank(comm):
    return comm.rank


def stores_on(comm):
    return _testing.stores(comm)["on"]


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
@pytest.mark.skipif(
    (os.cpu_count() or 1) > 7, reason="oversubscribing this host takes too many ranks"
)
def test_oversubscribed_ranks_keep_the_fixed_stores(pools):
    """More ranks than cores: rank 0's timings would hold the others' turns."""
    over = (os.cpu_count() or 1) + 1
    assert pools.run(over, stores_on) == [False] * over
    assert pools.run(2, stores_on) == [True] * 2


N_OTHER = 16384 // 4  # float32 elements: each round copies 16 KiB into a slot


def other_collectives(comm):
    """Every collective but all_reduce once, a rank's copy into a slot 16 KiB
    a round: per collective, whether its result is the reference's and how
    many of this rank's copies followed a non-temporal choice."""
    w, r = comm.world_size, comm.rank
    n = N_OTHER
    xs = [make(q, n, torch.float32, 5) for q in range(w)]
    big = [make(q, w * n, torch.float32, 6) for q in range(w)]
    mine = slice(r * n, (r + 1) * n)
    cases = {
        "broadcast": (lambda: comm.broadcast(xs[r].clone(), 0), xs[0]),
        "all_gather": (
            lambda: comm.all_gather_into_tensor(torch.empty(w * n), xs[r]),
            torch.cat(xs),
        ),
        "gather": (
            lambda: comm.gather(xs[r], 0, out=torch.empty(w * n) if r == 0 else None),
            torch.cat(xs) if r == 0 else None,
        ),
        "reduce_scatter": (
            lambda: comm.reduce_scatter_tensor(torch.empty(n), big[r]),
            reference(big, tpcomm.ReduceOp.SUM)[mine],
        ),
        "all_to_all": (
            lambda: comm.all_to_all_single(torch.empty(w * n), big[r]),
            torch.cat([b[mine] for b in big]),
        ),
        "sendrecv": (
            lambda: comm.sendrecv([xs[r]], (r + 1) % w, (r - 1) % w, out=[torch.empty(n)])[0],
            xs[(r - 1) % w],
        ),
    }
    out = {}
    for name, (call, want) in cases.items():
        before = _testing.stores(comm)["followed_nt"]
        got = call()
        right = got is None if want is None else torch.equal(got, want)
        out[name] = (right, _testing.stores(comm)["followed_nt"] - before)
    return out


def others_follow(comm, algo):
    """The other collectives before all_reduce learnt anything, after it chose
    non-temporal stores for 16 KiB (plain made slow), and after it went back."""
    runs = [other_collectives(comm)]
    for plain_us, nt_us in ((40.0, 0.0), (0.0, 40.0)):
        assert calls_until_settled(comm, plain_us, nt_us, algo)[1] == 0
        _testing.set_twoshot_min(comm, -1 if algo == "one-shot" else 0)
        try:
            runs.append(other_collectives(comm))
        finally:
            _testing.set_twoshot_min(comm, None)
    return runs


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
@pytest.mark.parametrize("algo", ["one-shot", "two-shot"])
def test_the_other_collectives_store_as_all_reduce_chose(algo):
    """A broadcast's, all_gather's, ... copies into a slot store as an
    all_reduce chunk of their size does: plain until it learns otherwise,
    non-temporal once it chose them, plain again after; results exact."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(others_follow, algo, timeout=300)
    for r, (before, nt, back) in enumerate(res):
        copies = {  # this rank's copies into a slot: one round each
            "broadcast": 1 if r == 0 else 0,
            "all_gather": 1,
            "gather": 1,
            "reduce_scatter": 1,
            "all_to_all": 1,
            "sendrecv": 1,
        }
        assert before == {k: (True, 0) for k in copies}, (r, before)
        assert nt == {k: (True, c) for k, c in copies.items()}, (r, nt)
        assert back == {k: (True, 0) for k in copies}, (r, back)


def untimed_sizes_follow(comm):
    """16 KiB learns non-temporal stores (plain made slow), then plain again:
    what a 256 KiB all_reduce that never ran would store, and whether a
    256 KiB broadcast's copies followed non-temporal stores, at each step."""

    def step():
        before = _testing.stores(comm)["followed_nt"]
        x = make(0, 65536, torch.float32, 7) if comm.rank == 0 else torch.empty(65536)
        comm.broadcast(x, 0)
        right = torch.equal(x, make(0, 65536, torch.float32, 7))
        named = engine_of(comm).stores_in_use(262144, torch.float32)
        return named, right, _testing.stores(comm)["followed_nt"] - before

    _testing.set_twoshot_min(comm, -1)
    try:
        out = [step()]
        for plain_us, nt_us in ((40.0, 0.0), (0.0, 40.0)):
            assert calls_until_settled(comm, plain_us, nt_us)[1] == 0
            _testing.set_twoshot_min(comm, -1)
            out.append(step())
        timed = _testing.stores(comm)["cost"]
    finally:
        _testing.set_twoshot_min(comm, None)
    return out, timed


@pytest.mark.skipif(not NT_KERNELS, reason="no non-temporal copy here: the choice is off")
def test_a_size_no_chunk_timed_follows_the_nearest_that_was():
    """The machine's state moves every size alike: a size met for the first
    time (and the other collectives' copies of it) starts from the choice of
    the nearest size that was timed, not from plain stores."""
    with LocalGroup(2, timeout=120) as g:
        res = g.run(untimed_sizes_follow, timeout=300)
    for r, (steps, cost) in enumerate(res):
        roots = 1 if r == 0 else 0  # the broadcast's root copies into its slot
        assert steps == [("plain", True, 0), ("nt", True, roots), ("plain", True, 0)], (r, steps)
        assert cost[BUCKET + 4] == (0.0, 0.0)  # 256 KiB itself was never timed

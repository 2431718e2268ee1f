"""all_reduce: every dtype x op x size x world size against independent references.

Guards the contract of the foundation: results equal a torch single-process
reference (float32 accumulation in rank order, one rounding; integers exact),
are bitwise identical on every rank and on every repetition, hold for sizes
0, 1, odd, unaligned and larger than the shared buffer (chunked), for
non-contiguous tensors, and cost one round (one wait) per small call.
"""

from __future__ import annotations

import pytest
import torch

import tpcomm
from tpcomm import _env, _testing

from ._helpers import zero_copy_matrix
from ._ref import DTYPES, FLOATS, OPS, digest, make, reference, reference_f64

WORLDS = [1, 2, 3, 4, 8]
SLOT = _env.DEFAULT_SLOT_BYTES
SMALL = [0, 1, 7, 1024 + 3]  # 1027 elements: 4 KiB of float32 plus 3, unaligned tail
LARGE = [SLOT // 4, 3 * SLOT // 4 + 5]  # 1 MiB of float32; larger than a slot (chunked)


def _cases(world: int):
    cases = []
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            if op is tpcomm.ReduceOp.AVG and dtype not in FLOATS:
                continue
            for n in SMALL:
                cases.append((seed, dtype, op, n))
                seed += 1
            # large sizes: every dtype with SUM, MAX also for float32 (keeps 8 oversubscribed
            # ranks fast; the kernels are shared between ops)
            if op is tpcomm.ReduceOp.SUM or (op is tpcomm.ReduceOp.MAX and dtype is torch.float32):
                for n in LARGE:
                    cases.append((seed, dtype, op, n))
                    seed += 1
    return cases


def _check_case(rank, world, seed, dtype, op, n):
    """Rank 0 checks against the references; every rank returns a digest."""
    x = make(rank, n, dtype, seed)
    before = x.data_ptr()
    out = tpcomm_all_reduce(x, op)
    assert out is x and x.data_ptr() == before, "all_reduce must work in place"
    problems = []
    if rank == 0:
        inputs = [make(r, n, dtype, seed) for r in range(world)]
        ref = reference(inputs, op)
        if not torch.equal(x, ref):
            bad = (x != ref).nonzero()[:3].flatten().tolist()
            problems.append(f"{dtype} {op.name} n={n}: differs from reference at {bad}")
        f64 = reference_f64(inputs, op)
        if dtype in FLOATS:
            eps = torch.finfo(dtype).eps
            mag = (
                torch.stack([i.double().abs() for i in inputs]).sum(0) if inputs[0].numel() else f64
            )
            tol = eps * (mag + f64.abs()) * 2 + 1e-30
            if not bool(((x.double() - f64).abs() <= tol).all()):
                problems.append(f"{dtype} {op.name} n={n}: beyond float64 tolerance")
        elif not torch.equal(x.double(), f64):
            problems.append(f"{dtype} {op.name} n={n}: integer result not exact")
    return digest(x), problems


_comm = None


def tpcomm_all_reduce(x, op):
    return _comm.all_reduce(x, op)


def run_matrix(comm, cases):
    global _comm
    _comm = comm
    digests, problems = [], []
    for seed, dtype, op, n in cases:
        d, p = _check_case(comm.rank, comm.world_size, seed, dtype, op, n)
        digests.append(d)
        problems += p
    return digests, problems


@pytest.mark.parametrize("world", WORLDS)
def test_matrix(pools, world):
    """Every dtype x op x size: equals the reference, bitwise equal across ranks."""
    cases = _cases(world)
    results = pools.run(world, run_matrix, cases)
    problems = [p for _, ps in results for p in ps]
    assert not problems, problems[:10]
    for r in range(1, world):
        for i, case in enumerate(cases):
            assert results[r][0][i] == results[0][0][i], f"rank {r} differs from rank 0 on {case}"


def repeat_and_rounds(comm):
    x0 = make(comm.rank, 1027, torch.bfloat16, 99)
    outs = []
    for _ in range(3):
        x = x0.clone()
        comm.all_reduce(x)
        outs.append(digest(x))
    r0 = _testing.rounds(comm)
    comm.all_reduce(torch.ones(1000))
    small_rounds = _testing.rounds(comm) - r0
    r0 = _testing.rounds(comm)
    big = torch.ones(3 * SLOT // 4 + 5)  # 3 full slots + 5 elements
    comm.all_reduce(big)
    big_rounds = _testing.rounds(comm) - r0
    two = 0 <= _testing.engine(comm).twoshot_min <= big.numel() * 4
    return outs, small_rounds, big_rounds // (2 if two else 1), float(big[0])


@pytest.mark.parametrize("world", [2, 3])
def test_repeatable_and_one_round(pools, world):
    """Repeating a call gives the same bits; a small call is one round, a large one a
    round per slot-sized chunk (two with the two-shot algorithm)."""
    results = pools.run(world, repeat_and_rounds)
    for outs, small_rounds, big_rounds, value in results:
        assert len(set(outs)) == 1
        assert outs == results[0][0]
        assert small_rounds == 1
        assert big_rounds == 4
        assert value == world


def non_contiguous(comm):
    r = comm.rank
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10) + 100 * r
    view = base[:, ::3]  # not contiguous
    assert not view.is_contiguous()
    untouched = base[:, 1].clone()
    comm.all_reduce(view, tpcomm.ReduceOp.MAX)
    t = (torch.arange(24, dtype=torch.int64).reshape(4, 6) + r).t()
    comm.all_reduce(t)
    return base.clone(), untouched, t.clone()


def test_non_contiguous(pools):
    """A strided view is reduced in place; the elements around it are untouched."""
    world = 3
    results = pools.run(world, non_contiguous)
    expect_view = (torch.arange(60, dtype=torch.float32).reshape(6, 10) + 100 * (world - 1))[:, ::3]
    expect_t = sum(
        (torch.arange(24, dtype=torch.int64).reshape(4, 6) + r).t() for r in range(world)
    )
    for base, untouched, t in results:
        assert torch.equal(base[:, ::3], expect_view)
        assert torch.equal(base[:, 1], untouched)
        assert torch.equal(t, expect_t)


def shapes_and_kwargs(comm):
    out = []
    x = torch.full((3, 4, 5), float(comm.rank + 1))
    out.append(comm.all_reduce(tensor=x, op=tpcomm.ReduceOp.AVG).clone())
    s = torch.tensor(float(comm.rank))  # 0-d
    comm.all_reduce(s, op=tpcomm.ReduceOp.MIN)
    out.append(s.clone())
    import torch.distributed as dist

    y = torch.full((5,), comm.rank + 1, dtype=torch.int32)
    comm.all_reduce(y, dist.ReduceOp.MAX)  # torch.distributed's ops are accepted
    out.append(y.clone())
    return out


def test_shapes_kwargs_and_dist_ops(pools):
    world = 2
    for avg, mn, mx in pools.run(world, shapes_and_kwargs):
        assert torch.equal(avg, torch.full((3, 4, 5), 1.5))
        assert mn.item() == 0.0 and mn.dim() == 0
        assert torch.equal(mx, torch.full((5,), 2, dtype=torch.int32))


def int_wrap(comm):
    x = torch.full((9,), 2**31 - 1, dtype=torch.int32)
    comm.all_reduce(x)
    return x


def test_int32_sum_wraps_like_torch(pools):
    world = 2
    expect = torch.full((9,), 2**31 - 1, dtype=torch.int32) * 2  # torch wraps too
    for x in pools.run(world, int_wrap):
        assert torch.equal(x, expect)


@pytest.mark.parametrize(
    "algo,world", [("twoshot", 2), ("twoshot", 3), ("twoshot", 4), ("oneshot", 3)]
)
def test_matrix_each_algorithm(monkeypatch, algo, world):
    """Two-shot (reduce-scatter + all-gather inside the segment) keeps the same
    contract: reference equality, bitwise equal across ranks, for every size."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_ALLREDUCE_ALGO", algo)
    cases = [c for c in _cases(world) if c[3] != 7 or c[1] is torch.float32]
    with LocalGroup(world, timeout=30) as g:
        results = g.run(run_matrix, cases, timeout=240)
    problems = [p for _, ps in results for p in ps]
    assert not problems, problems[:10]
    for r in range(1, world):
        assert results[r][0] == results[0][0]


def disagree_on_algorithm(comm):
    _testing.set_twoshot_min(comm, 0 if comm.rank == 0 else -1)
    x = torch.ones(1000)
    try:
        comm.all_reduce(x)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        _testing.set_twoshot_min(comm, None)


def test_ranks_disagreeing_on_the_algorithm_are_told(pools):
    msgs = pools.run(2, disagree_on_algorithm)
    for msg in msgs:
        assert "mismatched collective" in msg
        assert "algorithm=one-shot" in msg and "algorithm=two-shot" in msg, msg


def world16(comm):
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 1027, 300_000):
            x = make(comm.rank, n, dtype, 7)
            comm.all_reduce(x)
            if comm.rank == 0:
                ref = reference(
                    [make(r, n, dtype, 7) for r in range(comm.world_size)], tpcomm.ReduceOp.SUM
                )
                out.append(bool(torch.equal(x, ref)))
            out.append(digest(x))
    return out


def test_world_16(pools):
    """No fixed list of world sizes: 16 ranks (8 per core here) work too."""
    res = pools.run(16, world16)
    assert all(v is True for v in res[0] if isinstance(v, bool))
    digests = [[v for v in r if isinstance(v, str)] for r in res]
    assert all(d == digests[0] for d in digests)


def threads_in_use(comm):
    return _testing.threads(comm)


@pytest.mark.parametrize("world", [2, 3])
def test_threads_per_rank(monkeypatch, world):
    """Large copies and reductions split across 2 threads per rank: same results,
    bitwise, as the references (one-shot, two-shot and zero-copy all cover it)."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_THREADS", "2")
    big = [c for c in _cases(world) if c[3] in LARGE]
    with LocalGroup(world, timeout=30) as g:
        assert g.run(threads_in_use) == [2] * world
        for algo in ("oneshot", "twoshot"):
            results = g.run(run_matrix_algo, big, algo, timeout=240)
            problems = [p for _, ps in results for p in ps]
            assert not problems, (algo, problems[:10])
            assert all(res[0] == results[0][0] for res in results)
        zc = g.run(zero_copy_matrix, timeout=240)
        assert not [p for ps, _ in zc for p in ps]
        assert all(d == zc[0][1] for _, d in zc)


def chunks_in_use(comm):
    """The chunk and the rounds of a 1 MiB float32 all_reduce, one-shot and two-shot."""
    eng = _testing.engine(comm)
    rounds = []
    for algo in ("oneshot", "twoshot"):
        _testing.set_twoshot_min(comm, -1 if algo == "oneshot" else 0)
        before = _testing.rounds(comm)
        comm.all_reduce(torch.ones(SLOT // 4))
        rounds.append(_testing.rounds(comm) - before)
    _testing.set_twoshot_min(comm, None)
    return eng.chunk(SLOT), eng.chunk(SLOT - 1), rounds


@pytest.mark.parametrize("world", [2, 3])
def test_chunks_smaller_than_a_slot(monkeypatch, world):
    """From TPCOMM_CHUNK_MIN_BYTES an all_reduce goes through the slots
    TPCOMM_CHUNK_BYTES at a time: the rounds say so, and the results equal
    the references and are bitwise equal across ranks, one-shot and two-shot,
    for sizes that are and are not a multiple of the chunk."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_CHUNK_MIN_BYTES", str(SLOT))
    monkeypatch.setenv("TPCOMM_CHUNK_BYTES", "65536")
    big = [c for c in _cases(world) if c[3] in LARGE]
    with LocalGroup(world, timeout=30) as g:
        # 1 MiB: 16 chunks of 64 KiB (two rounds each two-shot); 1 MiB less a byte: a slot
        assert g.run(chunks_in_use) == [(65536, SLOT, [16, 32])] * world
        for algo in ("oneshot", "twoshot"):
            results = g.run(run_matrix_algo, big, algo, timeout=240)
            problems = [p for _, ps in results for p in ps]
            assert not problems, (algo, problems[:10])
            assert all(res[0] == results[0][0] for res in results)


# configurations of an all_reduce: engine settings, and a comm.empty tensor or not
PLANS = {
    "one-shot": ({"twoshot_min": -1, "twoshot_min16": -1, "chunk_min": -1}, False),
    "two-shot": ({"twoshot_min": 0, "twoshot_min16": 0, "chunk_min": -1}, False),
    "chunked one-shot": ({"twoshot_min": -1, "twoshot_min16": -1, "chunk_min": 0}, False),
    "chunked two-shot": ({"twoshot_min": 0, "twoshot_min16": 0, "chunk_min": 0}, False),
    "16-bit two-shot": ({"twoshot_min": -1, "twoshot_min16": 0, "chunk_min": -1}, False),
    "zero copy": ({"zc_min": 0, "zc_max": -1, "chunk_min": -1}, True),
    "zero copy in pieces": ({"zc_min": 0, "zc_max": -1, "chunk_min": 0}, True),
    "zero copy past its window": (
        {"zc_min": 0, "zc_max": 4096, "twoshot_min": 0, "twoshot_min16": 0, "chunk_min": -1},
        True,
    ),
    "single copy": ({"cma_ar_min": 0}, False),
}


def plans_and_rounds(comm, nbytes):
    """Per configuration and dtype: the algorithm and chunk all_reduce_plan
    names, the rounds a real all_reduce of nbytes took, and whether its result
    equals the float64 sum of every rank's data."""
    eng = _testing.engine(comm)
    cma = _testing.cma_init(comm, True, -1)[1]
    _testing.set_zero_copy_auto(comm, False)  # zero copy where the window says
    out = {}
    try:
        for name, (changes, symmetric) in PLANS.items():
            if name == "single copy" and not cma:
                continue
            eng.adjust(
                **{
                    **eng.settings._asdict(),
                    "chunk_bytes": 65536,
                    "zc_min": -1,
                    "zc_auto": False,
                    **changes,
                }
            )
            for dt in (torch.float32, torch.bfloat16):
                n = nbytes // dt.itemsize
                x = make(comm.rank, n, dt, 11)
                if symmetric:
                    x = comm.empty((n,), dt).copy_(x)
                before = _testing.rounds(comm)
                comm.all_reduce(x)
                took = _testing.rounds(comm) - before
                algo, chunk, stores = eng.all_reduce_plan(nbytes, dt, symmetric)
                ref = torch.stack([make(q, n, dt, 11).double() for q in range(comm.world_size)])
                tol = (1e-5, 1e-4) if dt is torch.float32 else (2e-2, 0.5)
                ok = torch.allclose(x.double(), ref.sum(0), *tol)
                out[name, str(dt)] = (algo, chunk, stores, took, ok)
                del x
    finally:
        _testing.restore(comm)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_plan_names_what_runs(pools, world):
    """all_reduce_plan (what tpcomm perf names) is the C core's own choice:
    for every algorithm, chunking and dtype the rounds a real all_reduce
    takes are the plan's (one-shot one a chunk, two-shot two a chunk, zero
    copy one a piece and two, single copy three), and the result is the
    float64 sum."""
    nbytes = 3 * 65536 + 64  # three chunks of 64 KiB and a bit, under a slot
    res = pools.run(world, plans_and_rounds, nbytes)
    assert all(r == res[0] for r in res), "ranks disagree"
    expect = {
        "one-shot": ("one-shot", SLOT, 1),
        "two-shot": ("two-shot", SLOT, 2),
        "chunked one-shot": ("one-shot", 65536, 4),
        "chunked two-shot": ("two-shot", 65536, 8),
        "zero copy": ("zero-copy", 0, 3),
        "zero copy in pieces": ("zero-copy", 65536, 4),  # the largest shard: 2 pieces
        "zero copy past its window": ("two-shot", SLOT, 2),
        "single copy": ("single-copy", 0, 3),
    }
    for (name, dt), (algo, chunk, stores, took, ok) in res[0].items():
        want = expect.get(name)
        if name == "16-bit two-shot":  # float32 one-shot, the 16-bit floats two-shot
            want = ("one-shot", SLOT, 1) if dt == "torch.float32" else ("two-shot", SLOT, 2)
        assert (algo, chunk, took) == want, (name, dt, algo, chunk, took)
        assert ok, (name, dt, "result")
        assert stores in (("plain", "nt") if algo in ("one-shot", "two-shot") else ("",))
    assert {n for n, _ in res[0]} >= set(PLANS) - {"single copy"}


def disagree_on_chunks(comm):
    eng = _testing.engine(comm)
    eng.adjust(chunk_min=0 if comm.rank == 0 else -1)
    try:
        comm.all_reduce(torch.ones(SLOT // 2))
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        eng.restore()


def test_ranks_chunking_differently_are_told(monkeypatch):
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_CHUNK_BYTES", "131072")
    with LocalGroup(2, timeout=30) as g:
        msgs = g.run(disagree_on_chunks, timeout=60)
    for msg in msgs:
        assert "mismatched collective" in msg
        assert "-shot in chunks of 128 KiB)" in msg, msg  # rank 0
        assert "-shot)" in msg, msg  # rank 1: a slot at a time


def test_chunk_settings_are_checked(monkeypatch):
    for name, bad in (("TPCOMM_CHUNK_MIN_BYTES", "-5"), ("TPCOMM_CHUNK_BYTES", "big")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(tpcomm.LaunchError, match=name):
            tpcomm.launch(_rank_of, 2, timeout=60)
        monkeypatch.delenv(name)
    monkeypatch.setenv("TPCOMM_CHUNK_BYTES", str(3 * 4096 + 5))  # to a page, at most a slot
    assert _env.chunk_bytes(SLOT) == 3 * 4096 and _env.chunk_bytes(8192) == 8192
    monkeypatch.delenv("TPCOMM_CHUNK_BYTES")
    l2 = _env.l2_bytes()  # default: half the L2 (64 KiB at least), or 256 KiB unknown
    assert _env.chunk_bytes(1 << 30) == (max(65536, l2 // 2) if l2 else 256 << 10)


def _rank_of(comm):
    return comm.rank


def run_matrix_algo(comm, cases, algo):
    _testing.set_twoshot_min(comm, -1 if algo == "oneshot" else 0)
    try:
        return run_matrix(comm, cases)
    finally:
        _testing.set_twoshot_min(comm, None)


def unaligned_by_both_algorithms(comm):
    """float32 SUM of tensors that start 4 bytes past a 64-byte line (a view),
    one-shot and two-shot, against the float64 sum: [(algo, n, ok)]."""
    out = []
    for algo in ("oneshot", "twoshot"):
        _testing.set_twoshot_min(comm, -1 if algo == "oneshot" else 0)
        for n in (33, 4099, 300_001):
            base = torch.zeros(n + 1)
            x = base[1:]
            x.copy_(make(comm.rank, n, torch.float32, 11))
            comm.all_reduce(x)
            ref = sum(make(r, n, torch.float32, 11).double() for r in range(comm.world_size))
            out.append((algo, n, bool(torch.allclose(x.double(), ref, 1e-5, 1e-4))))
    _testing.set_twoshot_min(comm, None)
    return out


def _nt_variants() -> list:
    return [isa for isa in ("avx2", "avx512") if isa in _testing.isa_variants()] or ["scalar"]


@pytest.mark.parametrize("isa", _nt_variants())
def test_non_temporal_copy_in(monkeypatch, isa):
    """TPCOMM_NT_MIN_BYTES=0: every copy into the segment uses streaming stores
    (the variant of the kernels in use: 512-bit with AVX-512, 256-bit with
    AVX2; with its sfence, unaligned head and byte tail); results stay exact,
    unaligned tensors too."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_NT_MIN_BYTES", "0")
    monkeypatch.setenv("TPCOMM_ISA", isa)
    cases = [c for c in _cases(2) if c[2] is tpcomm.ReduceOp.SUM]
    with LocalGroup(2, timeout=30) as g:
        results = g.run(run_matrix, cases, timeout=240)
        unaligned = g.run(unaligned_by_both_algorithms, timeout=120)
    assert not [p for _, ps in results for p in ps]
    assert results[0][0] == results[1][0]
    assert [ok for rank in unaligned for _, _, ok in rank] == [True] * 12


def where_inputs_lie(comm, nbytes, calls):
    """One-shot all_reduces of nbytes of float32, each of new data: per call,
    where in this rank's slot of the call's parity its input lies (found by
    searching the slot's bytes), and whether every result equals the float64
    sum of the ranks' inputs."""
    import ctypes

    eng = _testing.engine(comm)
    _testing.set_twoshot_min(comm, -1)
    try:
        found, ok = [], True
        for i in range(calls):
            x = make(comm.rank, nbytes // 4, torch.float32, 100 + i)
            mine = x.numpy().tobytes()
            n = _testing.rounds(comm) + 1  # the round this call publishes
            comm.all_reduce(x)
            slot = ctypes.string_at(eng.slot_addr(comm.rank, n & 1), eng.slot_bytes)
            found.append((n & 1, slot.find(mine)))
            inputs = [make(r, nbytes // 4, torch.float32, 100 + i) for r in range(comm.world_size)]
            ref = torch.stack([t.double() for t in inputs]).sum(0)
            ok = ok and torch.allclose(x.double(), ref, 1e-5, 1e-4)
        return found, ok
    finally:
        _testing.restore(comm)


def test_slot_positions_move(pools):
    """From 8 KiB a round's data moves one page-rounded span through its slot
    each time the parity comes back (tpcomm.h, slot_pos): the lines a rank
    writes were last read by its peers a slot ago, which halved a 16-64 KiB
    all_reduce on a VM where taking lines back from another core is slow.
    Below 8 KiB the data stays at the slot's start.  Results stay right."""
    for nbytes, moves in ((16384, True), (20 * 1024 + 4, True), (4096, False)):
        results = pools.run(2, where_inputs_lie, nbytes, 8)
        for found, ok in results:
            assert ok
            assert all(at >= 0 for _, at in found), found
            span = -(-nbytes // 4096) * 4096
            for parity in (0, 1):
                at = [a for p, a in found if p == parity]
                if moves:  # a new place each time, one span on (or back to the start)
                    assert len(set(at)) == len(at), (nbytes, found)
                    assert all(a % span == 0 for a in at), (nbytes, found)
                    ring = _env.DEFAULT_SLOT_BYTES // span * span
                    steps = [(b - a) % ring for a, b in zip(at, at[1:])]
                    assert set(steps) == {span}, (nbytes, found)
                else:
                    assert set(at) == {0}, (nbytes, found)


@pytest.mark.parametrize("world", [2, 3])
def test_positions_wrap_with_any_size_between(monkeypatch, world):
    """A small slot (64 KiB: 2 to 8 places for the sizes here), one-shot and
    two-shot, sizes in an order that puts each call's data over the last
    ones' of the same parity at other offsets, past the slot's end (chunked)
    and under the moving size: every result equals the references and is
    bitwise equal across ranks."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_SLOT_BYTES", "65536")
    sizes = [2048, 3 * 1024 + 7, 2048, 5000, 1024, 2048, 16384 + 3, 255, 2048, 40000, 2048, 2048]
    cases = [
        (500 + i, dt, tpcomm.ReduceOp.SUM, n)
        for i in range(3)
        for n in sizes
        for dt in (torch.float32, torch.bfloat16)
    ]
    for algo in ("oneshot", "twoshot"):
        monkeypatch.setenv("TPCOMM_ALLREDUCE_ALGO", algo)
        with LocalGroup(world, timeout=30) as g:
            results = g.run(run_matrix, cases, timeout=240)
        problems = [p for _, ps in results for p in ps]
        assert not problems, (algo, problems[:10])
        assert all(res[0] == results[0][0] for res in results)


def test_ranks_that_outnumber_the_cores_keep_one_place(pools):
    """Where the ranks outnumber the cores, rank 0 writes into the header that
    no round moves (ranks sharing a core find the fixed place in their own
    cache), and every rank follows it: 16 KiB stays at the slot's start."""
    import os

    world = (os.cpu_count() or 1) + 1
    if world > 8:
        pytest.skip(f"{world - 1} CPUs: a world that outnumbers them is too large to run here")
    for found, ok in pools.run(world, where_inputs_lie, 16384, 6):
        assert ok
        assert [at for _, at in found] == [0] * 6, found

"""all_gather(v), gather, broadcast, reduce_scatter(v) and the torch-style *_tensor forms.

Each collective is written once and run at world sizes 1, 2, 3, 4, 8 over dtypes,
shapes (0 elements, unaligned, larger than a slot) and dims, against torch on one
process (exact: these move or reduce data with the same float32 rule as all_reduce),
and bitwise across ranks.
"""

from __future__ import annotations

import pytest
import torch

import tpcomm
from tpcomm import _env

from ._helpers import SLACK_S, unexpected_errors
from ._ref import DTYPES, FLOATS, MOVE_DTYPES, digest, make, reference

WORLDS = [1, 2, 3, 4, 8]
BIG = _env.DEFAULT_SLOT_BYTES // 4 + 37  # float32 elements: more than one slot

SHAPES = [((0,), 0), ((1,), 0), ((7,), 0), ((3, 5), 1), ((3, 5), -2), ((2, 3, 4), 2), ((1027,), 0)]


def _with_dim(shape, d, size):
    return tuple(size if i == d else s for i, s in enumerate(shape))


def gather_family(comm, dtypes, big):
    r, w = comm.rank, comm.world_size
    out, problems = {}, []

    def check(name, got, want):
        if want is None:
            if got is not None:
                problems.append(f"{name}: expected None")
            return
        if got is None or got.dtype != want.dtype or not torch.equal(got, want):
            problems.append(f"{name}: differs from torch.cat")
        out[name] = digest(got)

    seed = 0
    for dtype in dtypes:
        shapes = SHAPES + [((0, 3), 1), ((2, 3, 0), 1)]
        if dtype in (torch.float32, torch.uint8):
            # more than a slot: dim 0, and rows whose blocks straddle the rounds
            shapes += [((big,), 0), ((5, big // 5 + 3), 1), ((3, 7, big // 21 + 1), -2)]
        for shape, dim in shapes:
            seed += 1
            x = make(r, shape, dtype, seed)
            parts = [make(q, shape, dtype, seed) for q in range(w)]
            check(
                f"all_gather {dtype} {shape} dim={dim}",
                comm.all_gather(x, dim),
                torch.cat(parts, dim),
            )
            dst = w - 1
            check(
                f"gather {dtype} {shape}",
                comm.gather(x, dst=dst, dim=dim),
                torch.cat(parts, dim) if r == dst else None,
            )
            # gather into a preallocated out= on dst, at every dim
            gshape = list(shape)
            gshape[dim] *= w
            o = torch.full(gshape, 3, dtype=dtype) if r == dst else None
            got = comm.gather(x, dst=dst, dim=dim, out=o)
            check(
                f"gather out= {dtype} {shape}",
                got,
                torch.cat(parts, dim) if r == dst else None,
            )
            if r == dst and got is not o:
                problems.append(f"gather out= {dtype} {shape}: did not return out")
            b = x.clone()
            src = w // 2
            comm.broadcast(b, src=src)
            check(f"broadcast {dtype} {shape}", b, parts[src])
            # ragged: rank q contributes (2q + 1) % 4 rows (zero included)
            if len(shape) >= 1:
                d = dim % len(shape)
                sizes = [(2 * q + 1) % 4 for q in range(w)]
                vparts = [
                    make(q, _with_dim(shape, d, sizes[q]), dtype, seed + 500) for q in range(w)
                ]
                check(
                    f"all_gatherv {dtype} {shape} dim={dim}",
                    comm.all_gatherv(vparts[r], sizes, dim),
                    torch.cat(vparts, d),
                )
            flat = x.reshape(-1)
            o = torch.empty(w * flat.numel(), dtype=dtype)
            comm.all_gather_into_tensor(o, flat)
            check(
                f"all_gather_into_tensor {dtype} {shape}",
                o,
                torch.cat([p.reshape(-1) for p in parts]),
            )
    return out, problems


@pytest.mark.parametrize("world", WORLDS)
def test_gather_family(pools, world):
    results = pools.run(world, gather_family, MOVE_DTYPES, BIG)
    problems = [p for _, ps in results for p in ps]
    assert not problems, problems[:10]
    # the same bits on every rank (gather: only dst has a result)
    for r in range(1, world):
        mine, first = results[r][0], results[0][0]
        common = set(mine) & set(first)
        assert len(common) >= len(first) - len(SHAPES) * len(MOVE_DTYPES)
        assert all(mine[k] == first[k] for k in common)


def scatter_family(comm, big):
    r, w = comm.rank, comm.world_size
    out, problems = [], []
    seed = 1000
    for dtype in DTYPES:
        for op in tpcomm.ReduceOp:
            if op is tpcomm.ReduceOp.AVG and dtype not in FLOATS:
                continue
            shapes = [((0, 3), 0), ((w, 3), 0), ((5, 2 * w), 1), ((2, 3, w), -1), ((3 * w,), 0)]
            shapes += [((0, 2 * w), 1), ((2, w, 0), 1)]
            if op is tpcomm.ReduceOp.SUM and dtype in (torch.float32, torch.bfloat16):
                # more than a slot: dim 0, and rows whose blocks straddle the rounds
                shapes += [((w * (big // w + 3),), 0), ((3, w * (big // (3 * w) + 5)), 1)]
            for shape, dim in shapes:
                seed += 1
                inputs = [make(q, shape, dtype, seed) for q in range(w)]
                full = reference(inputs, op)
                part = full.shape[dim] // w
                want = full.narrow(dim, r * part, part)
                got = comm.reduce_scatter(inputs[r], dim=dim, op=op)
                if got.shape != want.shape or not torch.equal(got, want):
                    problems.append(f"reduce_scatter {dtype} {op.name} {shape} dim={dim}")
                out.append(digest(torch.cat([got.reshape(-1)])))
                # uneven parts, zeros included
                d = dim % len(shape)
                sizes = [(q * 3 + 2) % 5 for q in range(w)]
                vshape = tuple(sum(sizes) if i == d else s for i, s in enumerate(shape))
                vin = [make(q, vshape, dtype, seed + 7) for q in range(w)]
                vfull = reference(vin, op)
                vwant = vfull.split(sizes, d)[r]
                vgot = comm.reduce_scatterv(vin[r], sizes, dim=dim, op=op)
                if vgot.shape != vwant.shape or not torch.equal(vgot, vwant):
                    problems.append(f"reduce_scatterv {dtype} {op.name} {vshape} sizes={sizes}")
                # torch-style
                flat = inputs[r].reshape(-1)
                if flat.numel() % w == 0:
                    o = torch.empty(flat.numel() // w, dtype=dtype)
                    comm.reduce_scatter_tensor(o, flat, op)
                    fw = full.reshape(-1).chunk(w)[r] if flat.numel() else o
                    if not torch.equal(o, fw):
                        problems.append(f"reduce_scatter_tensor {dtype} {op.name} {shape}")
    return out, problems


@pytest.mark.parametrize("world", WORLDS)
def test_scatter_family(pools, world):
    results = pools.run(world, scatter_family, BIG)
    problems = [p for _, ps in results for p in ps]
    assert not problems, problems[:10]


def gather_bitwise(comm):
    x = make(comm.rank, (33, 7), torch.bfloat16, 3)
    a = comm.all_gather(x, dim=1)
    rs = comm.reduce_scatter(torch.cat([x] * comm.world_size), op=tpcomm.ReduceOp.SUM)
    # the reduce_scatter shards, gathered, are the all_reduce: same bits on every rank
    full = comm.all_gather(rs)
    y = torch.cat([x] * comm.world_size)
    comm.all_reduce(y)
    return digest(a), digest(full), torch.equal(full, y)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bitwise_across_ranks_and_consistent_with_all_reduce(pools, world):
    res = pools.run(world, gather_bitwise)
    assert len({r[0] for r in res}) == 1
    assert len({r[1] for r in res}) == 1
    assert all(r[2] for r in res)


def bad_collective_args(comm):
    w = comm.world_size
    cases = [
        (lambda: comm.all_gather([1, 2]), TypeError, "all_gather: tensor must be a torch.Tensor"),
        (
            lambda: comm.all_gather(torch.ones(3), dim=1),
            ValueError,
            "all_gather: dim 1 is out of range",
        ),
        (lambda: comm.all_gather(torch.tensor(1.0)), ValueError, "0-d tensor has no dim"),
        (lambda: comm.gather(torch.ones(3), dst=w), ValueError, f"gather: dst={w} is out of range"),
        (
            lambda: comm.broadcast(torch.ones(3), src=-1),
            ValueError,
            "broadcast: src=-1 is out of range",
        ),
        (
            lambda: comm.broadcast(torch.ones(3), src="0"),
            TypeError,
            "broadcast: src must be an int",
        ),
        (
            lambda: comm.reduce_scatter(torch.ones(w * 2 + 1)),
            ValueError if w > 1 else None,
            "does not divide" if w > 1 else "reduce_scatter over one rank",
            torch.ones(3),
        ),
        (
            lambda: comm.reduce_scatter(torch.ones(w, dtype=torch.bool)),
            None,  # not in the engine: the private gloo group does it (logical or)
            "reduce_scatter of bool through torch.distributed",
            torch.ones(1, dtype=torch.bool),
        ),
        (lambda: comm.reduce_scatterv(torch.ones(5), [1] * w), ValueError, "sizes add up to"),
        (
            lambda: comm.reduce_scatterv(torch.ones(5), [5]),
            ValueError if w > 1 else None,
            "sizes must be a list of" if w > 1 else "reduce_scatterv over one rank",
            torch.ones(5),
        ),
        (lambda: comm.all_gatherv(torch.ones(2), [3] * w), ValueError, "but sizes["),
        (
            lambda: comm.all_gather_into_tensor(torch.empty(3), torch.ones(2)),
            ValueError,
            "output has 3 elements",
        ),
        (
            lambda: comm.all_gather_into_tensor(
                torch.empty(2 * w, dtype=torch.int32), torch.ones(2)
            ),
            TypeError,
            "differs from input dtype",
        ),
        (
            lambda: comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * w + 1)),
            ValueError,
            "input has",
        ),
    ]
    problems = unexpected_errors(cases)
    # still in step
    g = comm.all_gather(torch.tensor([comm.rank]))
    return problems, g.tolist()


@pytest.mark.parametrize("world", [1, 3])
def test_bad_collective_arguments(pools, world):
    for problems, g in pools.run(world, bad_collective_args):
        assert problems == []
        assert g == list(range(world))


def mismatched_gathers(comm, what):
    r = comm.rank
    try:
        if what == "shape":
            comm.all_gather(torch.ones(2, 3 + (r == 1)))
        elif what == "root":
            comm.broadcast(torch.ones(4), src=r % 2)
        elif what == "kind":
            if r == 0:
                comm.all_gather(torch.ones(4))
            else:
                comm.broadcast(torch.ones(4))
        elif what == "op":
            comm.reduce_scatter(torch.ones(4), op=tpcomm.ReduceOp.MAX if r else tpcomm.ReduceOp.SUM)
        result = "no error"
    except ValueError as e:
        result = str(e)
    ok = comm.all_gather(torch.tensor([r]))
    return result, ok.tolist()


@pytest.mark.parametrize("what", ["shape", "root", "kind", "op"])
def test_mismatched_collectives(pools, what):
    for msg, ok in pools.run(2, mismatched_gathers, what):
        assert "mismatched collective" in msg, msg
        assert ok == [0, 1]


def one_rank_refuses(comm):
    """Arguments only one rank can see are wrong (its tensor against the sizes,
    its output against its input): that rank raises its own error and the
    others, in the same call, a ValueError naming it, at once (not after the
    timeout); the group stays in step."""
    import time

    r, w = comm.rank, comm.world_size
    bad = r == 1
    calls = {
        "all_gatherv": lambda: comm.all_gatherv(torch.ones(3 if bad else 2), [2] * w),
        "reduce_scatterv": lambda: comm.reduce_scatterv(torch.ones(2 * w + bad), [2] * w),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(
            torch.empty(2 * w + bad), torch.ones(2)
        ),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * w + bad)
        ),
        "all_to_all_single": lambda: comm.all_to_all_single(
            torch.empty(w + bad), torch.ones(w + bad)
        ),
        "all_to_all_single dtype": lambda: comm.all_to_all_single(
            torch.empty(w, dtype=torch.int64 if bad else torch.float32), torch.ones(w)
        ),
        "all_gather_into_list": lambda: comm.all_gather_into_list(
            [torch.empty(2) for _ in range(w + bad)], torch.ones(2)
        ),
        # rank 1 is the root: only it reads outputs
        "gather_into_list": lambda: comm.gather_into_list(
            [torch.empty(2) for _ in range(w + bad)] if bad else None, torch.ones(2), dst=1
        ),
    }
    out = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            said = "no error"
        except (TypeError, ValueError) as e:
            said = str(e)
        out[name] = (said, time.monotonic() - t0)
    out["after"] = (comm.all_gather(torch.tensor([r])).tolist(), 0.0)
    return out


def test_arguments_one_rank_refuses_raise_on_every_rank(pools):
    res = pools.run(3, one_rank_refuses)
    for r, out in enumerate(res):
        assert out.pop("after")[0] == [0, 1, 2]
        for name, (said, took) in out.items():
            fn = name.split()[0]
            assert said.startswith(fn + ":"), (r, name, said)
            if r == 1:
                assert "refused" not in said, (name, said)  # its own reason
            else:
                assert "rank 1 refused its own arguments" in said, (r, name, said)
            assert took < SLACK_S, (r, name, took)  # not the 30 s timeout


def gather_bad_out(comm):
    """An out= that does not fit is seen on dst only: the gather still completes
    (the peers are not left waiting), dst raises, and the next collective works."""
    r, w = comm.rank, comm.world_size
    x = torch.full((2,), float(r))
    bad = torch.zeros(2 * w + 1) if r == 0 else None
    try:
        comm.gather(x, dst=0, out=bad)
        err = None
    except ValueError as e:
        err = str(e)
    untouched = bad is None or bool((bad == 0).all())
    wrong_dtype = torch.zeros(2 * w, dtype=torch.int64) if r == 0 else None
    try:
        comm.gather(x, dst=0, out=wrong_dtype)
        err2 = None
    except ValueError as e:
        err2 = str(e)
    after = comm.all_gather(x)
    return err, err2, untouched, after.tolist()


def test_gather_bad_out_raises_on_dst_only(pools):
    w = 3
    res = pools.run(w, gather_bad_out)
    err, err2, untouched, after = res[0]
    assert "out has dtype torch.float32 and shape (7,), expected torch.float32 and (6,)" in err
    assert "the gather itself completed" in err and "expected torch.float32" in err2
    assert untouched
    want = [float(q) for q in range(w) for _ in range(2)]
    for r in range(w):
        assert res[r][3] == want
        if r:
            assert res[r][:2] == (None, None)


def broadcast_mixed_paths(comm):
    """A plain tensor takes broadcast's one-call C path, a strided view the
    general Python path; both send the same metadata, so ranks on different
    paths work together (and different srcs still raise on every rank)."""
    r = comm.rank
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        base = (torch.arange(24) * (r + 1) % 5).to(dtype).reshape(4, 6)
        t = base.clone() if r % 2 == 0 else base.clone().t().contiguous().t()  # strided view
        if r % 2 == 1:
            assert not t.is_contiguous()
        comm.broadcast(t, src=1)
        want = (torch.arange(24) * 2 % 5).to(dtype).reshape(4, 6)
        out.append(bool(torch.equal(t, want)))
    try:
        comm.broadcast(torch.ones(3), src=r % 2)
        err = None
    except ValueError as e:
        err = str(e)
    return out, err


def all_gather_mixed_paths(comm):
    """all_gather_into_tensor of plain tensors is one C call, with a strided
    output it takes the general path, all_gather(t) of a 1-d tensor its own
    Python fast path: all three send the same metadata, so they work together;
    ranks that disagree on the size still raise on every rank."""
    r, w = comm.rank, comm.world_size
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        x = (torch.arange(6) + 10 * r).to(dtype)
        want = torch.cat([(torch.arange(6) + 10 * q).to(dtype) for q in range(w)])
        if r % 3 == 0:
            o = torch.empty(6 * w, dtype=dtype)
            comm.all_gather_into_tensor(o, x)
        elif r % 3 == 1:
            o = torch.empty(6 * w, 2, dtype=dtype)[:, 0]  # strided: the general path
            comm.all_gather_into_tensor(o, x)
        else:
            o = comm.all_gather(x)
        out.append(bool(torch.equal(o, want)))
    try:
        comm.all_gather_into_tensor(torch.empty(w * (3 + r % 2)), torch.ones(3 + r % 2))
        err = None
    except ValueError as e:
        err = str(e)
    return out, err


def gather_mixed_paths(comm):
    """gather of a plain 1-d tensor (dim 0 or -1) is one C call (fast_gather),
    of a strided 1-d view the general path: the same metadata on both, into out=
    or not, for every root; ranks that disagree on the size raise on every rank."""
    r, w = comm.rank, comm.world_size
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for dst in range(w):
            base = (torch.arange(10) + 10 * r).to(dtype)
            want = torch.cat([(torch.arange(10) + 10 * q).to(dtype) for q in range(w)])
            x = base.clone()
            if r % 3 == 1:
                x = torch.stack([base, base], 1)[:, 0]  # strided: the general path
                assert not x.is_contiguous()
            o = torch.empty(10 * w, dtype=dtype) if (r + dst) % 2 else None
            got = comm.gather(x, dst=dst, dim=-1 if r % 2 else 0, out=o)
            if r == dst:
                out.append(bool(torch.equal(got, want)) and (o is None or got is o))
            else:
                out.append(got is None)
    try:
        comm.gather(torch.ones(3 + r % 2), dst=0)
        err = None
    except ValueError as e:
        err = str(e)
    return out, err


@pytest.mark.parametrize(
    "fn,name",
    [
        (broadcast_mixed_paths, "broadcast"),
        (all_gather_mixed_paths, "all_gather"),
        (gather_mixed_paths, "gather"),
    ],
)
def test_fast_and_general_paths_agree(pools, fn, name):
    for out, err in pools.run(3, fn):
        assert all(out), out
        assert err is not None and name in err


def all_gather_1d_mismatch(comm):
    try:
        comm.all_gather(torch.ones(3 + comm.rank))
        return None
    except ValueError as e:
        return str(e)


def test_all_gather_1d_size_mismatch_raises_everywhere(pools):
    for err in pools.run(2, all_gather_1d_mismatch):
        assert err is not None and err.startswith("all_gather:"), err


def reduce_scatter_mixed_paths(comm):
    """reduce_scatter_tensor of plain tensors is one C call; a strided output
    takes the general path, reduce_scatter(t) its own: same metadata, so they
    work together; a different op or size on one rank raises on every rank."""
    r, w = comm.rank, comm.world_size
    out = []
    for dtype, op in (
        (torch.float32, tpcomm.ReduceOp.SUM),
        (torch.bfloat16, tpcomm.ReduceOp.AVG),
        (torch.int64, tpcomm.ReduceOp.MAX),
        (torch.int32, tpcomm.ReduceOp.MIN),
    ):
        x = ((torch.arange(4 * w) * 7 + 3 * r) % 11).to(dtype)
        parts = [((torch.arange(4 * w) * 7 + 3 * q) % 11).to(dtype) for q in range(w)]
        want = reference(parts, op).chunk(w)[r]
        if r % 3 == 0:
            o = torch.empty(4, dtype=dtype)
            comm.reduce_scatter_tensor(o, x, op)
        elif r % 3 == 1:
            o = torch.empty(4, 2, dtype=dtype)[:, 0]  # strided: the general path
            comm.reduce_scatter_tensor(o, x, op)
        else:
            o = comm.reduce_scatter(x, op=op)
        out.append(bool(torch.equal(o, want)))
    errs = []
    for kw in ({"op": tpcomm.ReduceOp.MAX if r == 0 else tpcomm.ReduceOp.SUM}, {"n": 4 + r % 2}):
        n = kw.get("n", 4)
        try:
            comm.reduce_scatter_tensor(
                torch.empty(n), torch.ones(n * w), kw.get("op", tpcomm.ReduceOp.SUM)
            )
            errs.append(None)
        except ValueError as e:
            errs.append(str(e))
    return out, errs


def test_reduce_scatter_fast_and_general_paths_agree(pools):
    for out, errs in pools.run(3, reduce_scatter_mixed_paths):
        assert all(out), out
        assert all(e is not None and "reduce_scatter" in e for e in errs), errs


def whole_call_entries(comm):
    """all_gather_into_tensor, reduce_scatter_tensor and gather are the
    engine's C entries (as all_reduce is): a positional call of plain tensors
    (gather: 1-d, its out= too) never runs the general road (Python's rounds,
    stubbed to raise here); keywords, op left out, and a strided tensor take
    the general road or the C default and agree with it; a wrong call raises
    TypeError naming the method."""
    r, w = comm.rank, comm.world_size
    kinds = {
        name: type(getattr(comm, name)).__name__
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "gather")
    }
    x = torch.arange(4, dtype=torch.float32) + 10 * r
    want_ag = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * q for q in range(w)])
    y = torch.arange(4 * w, dtype=torch.float32) * (r + 1)
    want_rs = (torch.arange(4 * w, dtype=torch.float32) * sum(range(1, w + 1))).chunk(w)[r]

    def general(*args):
        raise AssertionError("a plain positional call took the general road")

    ok = []
    comm._gatherv = general  # the pool's communicator: put back below
    comm._reduce_scatterv = general
    try:
        out = torch.empty(4 * w)
        ok.append(comm.all_gather_into_tensor(out, x) is out and torch.equal(out, want_ag))
        o = torch.empty(4)
        ok.append(comm.reduce_scatter_tensor(o, y) is o and torch.equal(o, want_rs))
        o = torch.empty(4)
        got = comm.reduce_scatter_tensor(o, y, tpcomm.ReduceOp.MAX)
        ok.append(got is o and torch.equal(o, (torch.arange(4 * w) * w).chunk(w)[r].float()))
        # gather: into out= on dst, into a new tensor, with keywords and dim=-1
        g = torch.full((4 * w,), -1.0)
        got = comm.gather(x, 0, out=g)
        ok.append(got is g and torch.equal(g, want_ag) if r == 0 else got is None)
        got = comm.gather(x, w - 1)
        ok.append(torch.equal(got, want_ag) if r == w - 1 else got is None)
        got = comm.gather(tensor=x, dim=-1, dst=1)
        ok.append(torch.equal(got, want_ag) if r == 1 else got is None)
    finally:
        del comm._gatherv, comm._reduce_scatterv
    # keywords (every rank) and a strided output (rank 1): the general road, the same rounds
    out = torch.empty(4 * w, 2)[:, 0] if r == 1 else torch.empty(4 * w)
    got = comm.all_gather_into_tensor(output=out, input=x)
    ok.append(got is out and torch.equal(out, want_ag))
    o = torch.empty(4)
    got = comm.reduce_scatter_tensor(o, input=y, op=tpcomm.ReduceOp.SUM)
    ok.append(got is o and torch.equal(o, want_rs))
    # gather of a strided tensor (rank 1) and of rows: the other roads, same result
    xs = torch.stack([x, x], 1)[:, 0] if r == 1 else x
    got = comm.gather(xs, 0, 0, out=torch.empty(4 * w))
    ok.append(torch.equal(got, want_ag) if r == 0 else got is None)
    got = comm.gather(x.view(2, 2), 0)
    ok.append(torch.equal(got, want_ag.view(2 * w, 2)) if r == 0 else got is None)
    try:  # a dim past a C long is not -1: the method's check raises
        comm.gather(x, 0, 2**70)
        ok.append(False)
    except ValueError as e:
        ok.append("dim" in str(e))
    errors = []
    for call in (
        lambda: comm.all_gather_into_tensor(torch.empty(4 * w)),
        lambda: comm.reduce_scatter_tensor(torch.empty(4), y, tpcomm.ReduceOp.SUM, 1),
        lambda: comm.all_gather_into_tensor(torch.empty(4 * w), x, tensor=x),
        lambda: comm.gather(),
        lambda: comm.gather(x, 0, 0, torch.empty(4 * w)),
        lambda: comm.gather(x, 0, tensor=x),
    ):
        try:
            call()
            errors.append(None)
        except TypeError as e:
            errors.append(str(e))
    return kinds, ok, errors, comm.all_reduce(torch.ones(2)).tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_whole_call_entries(pools, world):
    for kinds, ok, errors, y in pools.run(world, whole_call_entries):
        assert kinds == dict.fromkeys(kinds, "builtin_function_or_method"), kinds
        assert all(ok), ok
        assert "all_gather_into_tensor()" in errors[0], errors
        assert "reduce_scatter_tensor()" in errors[1], errors
        assert "all_gather_into_tensor()" in errors[2] and "tensor" in errors[2], errors
        assert all("gather()" in e for e in errors[3:]), errors
        assert y == [float(world)] * 2


def all_to_all_cases(comm):
    """Communicator.all_to_all_single against the definition, computed locally
    from every rank's data: even blocks, uneven split sizes with zeros, rows of
    several elements, any dtype; then bad splits raise on every rank."""
    import random

    r, w = comm.rank, comm.world_size
    bad = []
    for case, dtype in enumerate(
        [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.uint8]
    ):
        rng = random.Random(case)  # the same table on every rank
        table = [[rng.choice([0, 1, 2, 5, 300]) for _ in range(w)] for _ in range(w)]
        rest = rng.choice([(), (3,), (2, 5)])
        for even in (True, False):
            sends = [[4] * w for _ in range(w)] if even else table
            xs = [make(q, (sum(sends[q]), *rest), dtype, 50 + case) for q in range(w)]
            want = torch.cat([xs[q][sum(sends[q][:r]) : sum(sends[q][: r + 1])] for q in range(w)])
            out = torch.full((sum(sends[q][r] for q in range(w)), *rest), 0, dtype=dtype)
            if even:
                got = comm.all_to_all_single(out, xs[r])
            else:
                got = comm.all_to_all_single(out, xs[r], [sends[q][r] for q in range(w)], sends[r])
            if got is not out or not torch.equal(out, want):
                bad.append((dtype, even, rest))
    errors = []
    if w > 1:
        # rank 0 sends rank 1 two rows, rank 1 expects three
        ins = [2 if (r == 0 and q == 1) else 1 for q in range(w)]
        outs = [3 if (r == 1 and q == 0) else 1 for q in range(w)]
        try:
            comm.all_to_all_single(torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    y = comm.all_reduce(torch.ones(2))
    return bad, errors, y.tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_single(pools, world):
    for bad, errors, y in pools.run(world, all_to_all_cases):
        assert bad == []
        for e in errors:
            assert e == "all_to_all_single: rank 0 sends 2 rows to rank 1, which expects 3 from it"
        assert y == [float(world)] * 2


def all_to_all_mixed_paths(comm):
    """all_to_all_single of plain tensors is one C call; a strided output or
    split sizes in a tuple take the general path: the same rounds and split
    table, so ranks on either path work together, with and without split
    sizes, and a table that does not add up raises the same ValueError on
    every rank, whichever path each is on; the group stays usable."""
    r, w = comm.rank, comm.world_size
    table = [[(3 * q + 2 * j) % 5 for j in range(w)] for q in range(w)]  # zeros too
    bad = []
    for even in (True, False):
        sends = [[3] * w for _ in range(w)] if even else table
        xs = [make(q, (sum(sends[q]), 4), torch.float32, 90) for q in range(w)]
        want = torch.cat([xs[q][sum(sends[q][:r]) : sum(sends[q][: r + 1])] for q in range(w)])
        rows = sum(sends[q][r] for q in range(w))
        ins, outs = sends[r], [sends[q][r] for q in range(w)]
        # a strided output: the general path
        out = torch.zeros(rows, 8)[:, ::2] if r % 3 == 1 else torch.zeros(rows, 4)
        if even:
            comm.all_to_all_single(out, xs[r])
        elif r % 3 == 2:
            comm.all_to_all_single(out, xs[r], tuple(outs), tuple(ins))  # the general path
        else:
            comm.all_to_all_single(out, xs[r], outs, ins)
        if not torch.equal(out, want):
            bad.append(("even" if even else "splits", r % 3))
    errors = []
    for how in ("list", "tuple"):
        ins = [2 if (r == 0 and q == 1) else 1 for q in range(w)]
        outs = [3 if (r == 1 and q == 0) else 1 for q in range(w)]
        if how == "tuple" and r % 2:
            ins, outs = tuple(ins), tuple(outs)
        try:
            comm.all_to_all_single(torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return bad, errors, comm.all_reduce(torch.ones(2)).tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_fast_and_general_paths_agree(pools, world):
    for bad, errors, y in pools.run(world, all_to_all_mixed_paths):
        assert bad == []
        assert (
            errors
            == ["all_to_all_single: rank 0 sends 2 rows to rank 1, which expects 3 from it"] * 2
        )
        assert y == [float(world)] * 2


def all_to_all_one_call(comm):
    """With plain tensors, all_to_all_single never enters the Python rounds
    (ShmPath._all_to_all): even blocks, split sizes, and torch's empty lists."""

    def python_rounds(*args):
        raise AssertionError("all_to_all_single took the Python path")

    comm._shm._all_to_all = python_rounds  # the pool's communicator: put back below
    try:
        r, w = comm.rank, comm.world_size
        x = torch.arange(2 * w, dtype=torch.int64) + 100 * r
        got = [
            comm.all_to_all_single(torch.empty(2 * w, dtype=torch.int64), x, *splits)
            for splits in ((), ([], []), ([2] * w, [2] * w))
        ]
    finally:
        del comm._shm._all_to_all
    want = torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * q for q in range(w)])
    return [torch.equal(t, want) for t in got]


def test_all_to_all_of_plain_tensors_is_one_call(pools):
    assert pools.run(2, all_to_all_one_call) == [[True] * 3] * 2


def all_to_all_huge_splits(comm):
    """Split sizes that do not fit in 64 bits, or whose sums wrap around 2**64
    (every rank's table consistent with the others'), are a ValueError on
    every rank, before any data moves; the group stays usable.  Rank 2 takes
    the general path (a strided output)."""
    r, w = comm.rank, comm.world_size
    big = 2**63 - 1
    wraps = [[big, big, 5], [big, 5, big], [5, big, big]]  # each row and column sums to 3 mod 2**64
    cases = (
        ([1] * w, [2**64, 0, 0] if r == 0 else [1] * w),
        (wraps[r], wraps[r]),  # symmetric: what r receives from q is what q sends r
    )
    errors = []
    for outs, ins in cases:
        out = torch.zeros(3, 4)[:, ::2] if r == 2 else torch.zeros(3, 2)
        try:
            comm.all_to_all_single(out, torch.zeros(3, 2), outs, ins)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors, comm.all_reduce(torch.ones(2)).tolist()


def test_all_to_all_huge_splits_raise_on_every_rank(pools):
    for errors, y in pools.run(3, all_to_all_huge_splits):
        assert "rank 0's split sizes are not 3 sizes >= 0 (and below 2**63)" in errors[0], errors
        assert "rank 0's split sizes" in errors[1] and "do not sum" in errors[1], errors
        assert y == [3.0, 3.0]


def aliased_in_place(comm):
    """The in-place forms frameworks use: all_gather_into_tensor whose input is
    this rank's chunk of the output (FSDP), reduce_scatter_tensor whose output
    is this rank's chunk of the input, all_to_all_single(a, a), sendrecv into
    the tensor it sends (a shift around the ring); and inputs and outputs that
    overlap anywhere else (another rank's chunk, straddling two), which must
    give the result of the same call on separate tensors.  Sizes below one
    slot and across several."""
    r, w = comm.rank, comm.world_size
    bad = []
    for n in (5, 1000, 300_000, 700_001):
        gathered = torch.cat([make(q, n, torch.float32, 70) for q in range(w)])
        for where, at in (("own", r * n), ("next", (r + 1) % w * n), ("straddling", n // 2 + 1)):
            out = torch.empty(w * n)
            inp = out[at : at + n]
            inp.copy_(make(r, n, torch.float32, 70))
            comm.all_gather_into_tensor(out, inp)
            if not torch.equal(out, gathered):
                bad.append(("all_gather_into_tensor", where, n))
            # gather into an out= that holds the input (on the root; the others
            # send from inside a tensor of the same layout)
            out = torch.empty(w * n)
            inp = out[at : at + n]
            inp.copy_(make(r, n, torch.float32, 70))
            got = comm.gather(inp, 0, out=out if r == 0 else None)
            if r == 0 and not (got is out and torch.equal(out, gathered)):
                bad.append(("gather", where, n))
        xs = [make(q, w * n, torch.float32, 71) for q in range(w)]
        want = reference(xs, tpcomm.ReduceOp.SUM)[r * n : (r + 1) * n]
        for where, at in (("own", r * n), ("next", (r + 1) % w * n), ("straddling", n // 2 + 3)):
            x = xs[r].clone()
            o = x[at : at + n]
            comm.reduce_scatter_tensor(o, x)
            if not torch.equal(o, want):
                bad.append(("reduce_scatter_tensor", where, n))
        a = make(r, w * n, torch.int64, 72)
        comm.all_to_all_single(a, a)
        want = torch.cat([make(q, w * n, torch.int64, 72)[r * n : (r + 1) * n] for q in range(w)])
        if not torch.equal(a, want):
            bad.append(("all_to_all_single", n))
        # sendrecv: receive into what is sent, around the ring and, with two
        # tensors, each received into the other one's memory
        prev = (r - 1) % w
        x = make(r, n, torch.float32, 73)
        comm.sendrecv([x], (r + 1) % w, prev, out=[x])
        if not torch.equal(x, make(prev, n, torch.float32, 73)):
            bad.append(("sendrecv", "in place", n))
        if w > 1:
            y, z = make(r, n, torch.float32, 74), make(r, n, torch.float32, 75)
            comm.sendrecv([y, z], (r + 1) % w, prev, out=[z, y])
            if not (
                torch.equal(z, make(prev, n, torch.float32, 74))
                and torch.equal(y, make(prev, n, torch.float32, 75))
            ):
                bad.append(("sendrecv", "swapped", n))
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_aliased_in_place_forms(pools, world):
    assert pools.run(world, aliased_in_place) == [[]] * world


def world_one_gather(comm):
    buf = torch.arange(10, dtype=torch.float32)
    comm.all_gather_into_tensor(buf[:5], buf[:5])  # in place
    same = buf[:5].tolist()
    want = buf[1:6].clone()
    comm.all_gather_into_tensor(buf[:5], buf[1:6])  # shifted by one
    return same, buf[:5].tolist() == want.tolist()


def test_world_one_all_gather_into_overlapping_output():
    """World size 1 gives what the other sizes give: all_gather_into_tensor whose
    output overlaps its input (in place, or shifted) is the input, as if they did
    not overlap (it raised torch's own RuntimeError from copy_)."""
    from tpcomm.launch import LocalGroup

    with LocalGroup(1) as g:
        assert g.run(world_one_gather) == [([0.0, 1.0, 2.0, 3.0, 4.0], True)]


def families_in_a_small_slot(comm):
    """The families above with sizes of 8-64 KiB, whose rounds place their
    data further on in the slot each time (tpcomm.h, slot_pos)."""
    _, gathers = gather_family(comm, [torch.float32, torch.bfloat16], 3000)
    _, scatters = scatter_family(comm, 3000)
    bad, _, y = all_to_all_cases(comm)
    return gathers + scatters + [f"all_to_all_single {b}" for b in bad], y


@pytest.mark.parametrize("world", [2, 3])
def test_moving_slot_positions_with_a_small_slot(monkeypatch, world):
    """With a 64 KiB slot a round of 8 KiB or more has 2 to 8 places, so the
    families' many calls of mixed sizes (8-64 KiB, smaller and larger ones
    between) come round to the start again and again; every result still
    equals torch on one process."""
    from tpcomm.launch import LocalGroup

    monkeypatch.setenv("TPCOMM_SLOT_BYTES", "65536")
    with LocalGroup(world, timeout=30) as g:
        results = g.run(families_in_a_small_slot, timeout=240)
    problems = [p for ps, _ in results for p in ps]
    assert not problems, problems[:10]
    assert all(y == [float(world)] * 2 for _, y in results)

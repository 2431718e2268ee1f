"""The torch.distributed backend "tpcomm": plain dist.* calls over shared memory.

Every rank initialises the default group with "cpu:tpcomm" and makes a gloo
group of the same ranks; each collective runs on both, on the same data, and
the results must agree (exactly for data movement and integer or small-value
sums, within float32 tolerance otherwise)."""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _testing

from ._helpers import SLACK_S, free_port, init_dist


def _tpcomm_world(comm, port, backend="cpu:tpcomm"):
    """The world on ``backend`` (tpcomm's), and a gloo group to compare with."""
    init_dist(comm, port, backend)
    return dist.new_group(backend="gloo")


def routed(comm, port):
    gloo = _tpcomm_world(comm, port)
    r, w = dist.get_rank(), dist.get_world_size()
    checks = {}
    try:
        pg = dist.group.WORLD
        checks["is tpcomm"] = isinstance(pg, tpcomm.ProcessGroupTpcomm)
        checks["backend name"] = dist.get_backend() == "cpu:tpcomm"
        gen = torch.Generator().manual_seed(7 + r)

        def both(name, fn, *inputs, exact=True):
            a = [t.clone() for t in inputs]
            half = inputs[0].dtype == torch.bfloat16
            # bfloat16: the reference is gloo in float64, rounded once at the end
            b = [t.double() if half else t.clone() for t in inputs]
            ra = fn(a, None)
            rb = fn(b, gloo)
            ra = a if ra is None else ra
            rb = b if rb is None else rb
            if half:
                rb = [t.to(torch.bfloat16) for t in rb]
            tol = 1e-2 if half else 1e-5
            ok = all(
                torch.equal(x, y) if exact else torch.allclose(x, y, rtol=tol, atol=tol)
                for x, y in zip(ra, rb)
            )
            checks[name] = ok

        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float64):
            x = (torch.randn(1000, generator=gen) * 10).to(dtype)
            for op in ("SUM", "MAX", "MIN", "PRODUCT"):
                if op == "PRODUCT":
                    x = torch.full((5,), float(r + 2)).to(dtype)
                both(
                    f"all_reduce {dtype} {op}",
                    lambda t, g, op=op: dist.all_reduce(t[0], getattr(dist.ReduceOp, op), group=g),
                    x,
                    exact=not dtype.is_floating_point or op != "SUM",
                )
        both("all_gather", lambda t, g: _ag(t[0], g, w), torch.randn(3, 5, generator=gen))
        both(
            "all_gather_into_tensor",
            lambda t, g: [_agit(t[0], g, w)],
            torch.arange(6, dtype=torch.int32) * (r + 1),
        )
        both(
            "reduce_scatter_tensor",
            lambda t, g: [_rst(t[0], g, w)],
            torch.arange(4.0 * w) * (r + 1),
        )
        both("reduce_scatter (lists)", lambda t, g: [_rs(t[0], g, w)], torch.arange(3.0 * w) + r)
        for src in range(w):
            both(
                f"broadcast from {src}",
                lambda t, g, src=src: dist.broadcast(t[0], src, group=g),
                torch.full((9,), float(r)),
            )
        both("all_to_all_single", lambda t, g: [_a2a(t[0], g, w)], torch.arange(2.0 * w) + 100 * r)
        both(
            "all_to_all_single uneven",
            lambda t, g: [_a2a_uneven(t[0], g, w, r)],
            torch.arange(float(sum(range(1, w + 1)))) + 100 * r,
        )
        both("all_to_all (lists)", lambda t, g: _a2a_list(t[0], g, w), torch.arange(3.0 * w) + r)
        for big in (1, 30_000):  # blocks of up to 60 002 rows of 12 bytes: several rounds
            rows = (torch.arange(2 * (big + 1) * w * 3, dtype=torch.int32) + 1000 * r).view(-1, 3)
            both(
                f"all_to_all_single rows, uneven, {big}",
                lambda t, g, big=big: [_a2a_rows(t[0], g, w, r, big)],
                rows,
            )
        both("gather", lambda t, g: _gather(t[0], g, w, r), torch.full((4,), float(r)))
        both(
            "all_gather (lists, mixed paths)",
            lambda t, g: _ag_mixed(t[0], g, w, r),
            torch.arange(7, dtype=torch.int64) * (r + 3),
        )
        both(
            "gather (strided outputs on the root)",
            lambda t, g: _gather_mixed(t[0], g, w, r, w - 1),
            torch.arange(5.0) + 10 * r,
        )
        both("scatter", lambda t, g: [_scatter(g, w, r)], torch.zeros(1))
        both("reduce", lambda t, g: _reduce(t[0], g, r), torch.full((3,), r + 1.0))
        both(
            "all_reduce_coalesced",
            lambda t, g: dist.all_reduce_coalesced(t, group=g),
            torch.ones(3) * r,
            torch.arange(4.0),
        )
        # functional collectives (what traced torch code calls) reach the group too
        import torch.distributed._functional_collectives as funcol

        fx = funcol.all_reduce(torch.full((3,), float(r + 1)), "sum", dist.group.WORLD)
        checks["functional all_reduce"] = torch.equal(
            fx.wait() if hasattr(fx, "wait") else fx, torch.full((3,), float(sum(range(1, w + 1))))
        )
        objs = [None] * w
        dist.all_gather_object(objs, {"rank": r})
        checks["all_gather_object"] = objs == [{"rank": q} for q in range(w)]
        dist.barrier()
        if w > 1:  # point to point in a ring, both ways at once
            nxt, prv = (r + 1) % w, (r - 1) % w
            out = torch.empty(5, dtype=torch.int64)
            if r % 2 == 0:
                dist.send(torch.arange(5) + r, nxt)
                dist.recv(out, prv)
            else:
                dist.recv(out, prv)
                dist.send(torch.arange(5) + r, nxt)
            checks["send/recv"] = out.tolist() == (torch.arange(5) + prv).tolist()
            reqs = [
                dist.isend(torch.full((2,), float(r)), nxt),
                dist.irecv(out2 := torch.empty(2), prv),
            ]
            for q in reqs:
                q.wait()
            checks["isend/irecv"] = out2.tolist() == [float(prv)] * 2
        # async_op gives a Work that is complete and holds the outputs
        y = torch.ones(4) * (r + 1)
        work = dist.all_reduce(y, async_op=True)
        fut = work.get_future()
        checks["async wait"] = work.wait() is True and work.is_completed()
        checks["async value"] = torch.equal(
            fut.wait()[0], torch.full((4,), float(sum(range(1, w + 1))))
        )
        checks["async then"] = torch.equal(
            fut.then(lambda f: f.value()[0] * 2).wait(),
            torch.full((4,), 2.0 * sum(range(1, w + 1))),
        )
        return checks
    finally:
        dist.destroy_process_group()


def _ag(x, g, w):
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x, group=g)
    return parts


def _ag_mixed(x, g, w, r):
    # odd ranks gather into strided views (the temporary-and-copy path), even
    # ranks into plain tensors (straight into them): both must agree
    if r % 2:
        parts = [torch.empty(x.numel(), 2, dtype=x.dtype)[:, 1] for _ in range(w)]
    else:
        parts = [torch.empty(x.numel(), dtype=x.dtype) for _ in range(w)]
    dist.all_gather(parts, x.reshape(-1), group=g)
    return [p.contiguous() for p in parts]


def _gather_mixed(x, g, w, r, root):
    parts = None
    if r == root:
        parts = [torch.empty(x.numel(), 3, dtype=x.dtype)[:, 2] for _ in range(w)]
    dist.gather(x, parts, dst=root, group=g)
    return [p.contiguous() for p in parts] if r == root else [x]


def _agit(x, g, w):
    out = torch.empty(w * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x, group=g)
    return out


def _rst(x, g, w):
    out = torch.empty(x.numel() // w)
    dist.reduce_scatter_tensor(out, x, group=g)
    return out


def _rs(x, g, w):
    if g is not None:  # gloo has no reduce_scatter: all_reduce and slice
        y = x.clone()
        dist.all_reduce(y, group=g)
        return y.chunk(w)[dist.get_rank()]
    out = torch.empty(x.numel() // w)
    dist.reduce_scatter(out, list(x.chunk(w)))
    return out


def _a2a(x, g, w):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=g)
    return out


def _a2a_uneven(x, g, w, r):
    ins = list(range(1, w + 1))  # rank r sends q+1 elements to rank q
    outs = [r + 1] * w
    out = torch.empty(sum(outs))
    dist.all_to_all_single(out, x, outs, ins, group=g)
    return out


def _a2a_rows(x, g, w, r, big):
    # 2-d rows, uneven (zeros included); with big, blocks larger than a slot segment
    ins = [((r + q) % 3) * (big + 1) for q in range(w)]
    outs = [((q + r) % 3) * (big + 1) for q in range(w)]
    x = x[: sum(ins)]
    out = torch.empty(sum(outs), x.shape[1], dtype=x.dtype)
    dist.all_to_all_single(out, x, outs, ins, group=g)
    return out


def _a2a_list(x, g, w):
    outs = [torch.empty(3) for _ in range(w)]
    dist.all_to_all(outs, list(x.chunk(w)), group=g)
    return outs


def _gather(x, g, w, r):
    parts = [torch.empty_like(x) for _ in range(w)] if r == 0 else None
    dist.gather(x, parts, dst=0, group=g)
    return parts if r == 0 else [x]


def _scatter(g, w, r):
    out = torch.empty(3)
    parts = [torch.full((3,), 10.0 + q) for q in range(w)] if r == 0 else None
    dist.scatter(out, parts, src=0, group=g)
    return out


def _reduce(x, g, r):
    dist.reduce(x, 0, group=g)
    return [x] if r == 0 else []


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_routed_collective_matches_gloo(world):
    res = tpcomm.launch(routed, world, args=(free_port(),), timeout=240)
    for checks in res:
        assert checks and all(checks.values()), {k: v for k, v in checks.items() if not v}


def a2a_bad_splits(comm, port):
    _tpcomm_world(comm, port)
    r, w = dist.get_rank(), dist.get_world_size()
    errors = []
    try:
        cases = [
            # rank 0 sends rank 1 two rows, rank 1 expects three
            (
                [2 if q == 1 and r == 0 else 1 for q in range(w)],
                [3 if r == 1 and q == 0 else 1 for q in range(w)],
            ),
            # rank w-1's splits do not sum to its rows
            ([1] * w, [1] * (w - 1) + [2 if r == w - 1 else 1]),
            # rank 0 has a negative split
            ([2, -1] + [1] * (w - 2) if r == 0 else [1] * w, [1] * w),
        ]
        for ins, outs in cases:
            x = torch.zeros(max(0, sum(ins)), 2)
            out = torch.zeros(sum(outs) if r != w - 1 or outs == [1] * w else w, 2)
            try:
                dist.all_to_all_single(out, x, outs, ins)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        # the group still works afterwards
        y = torch.ones(2)
        dist.all_reduce(y)
        errors.append(y.tolist() == [float(w)] * 2)
        return errors
    finally:
        dist.destroy_process_group()


def test_all_to_all_bad_splits_raise_on_every_rank():
    res = tpcomm.launch(a2a_bad_splits, 3, args=(free_port(),), timeout=120)
    for errors in res:
        assert errors[0] and "rank 0 sends 2 rows to rank 1, which expects 3" in errors[0], errors
        assert errors[1] and "do not sum" in errors[1], errors
        assert errors[2] and "rank 0's split sizes are not 3 sizes >= 0" in errors[2], errors
        assert errors[3] is True


def subgroups(comm, port):
    _tpcomm_world(comm, port)
    r = dist.get_rank()
    try:
        a = dist.new_group([0, 1])
        b = dist.new_group([1, 2, 3])
        ga = dist.new_group([0, 1], backend="gloo")
        gb = dist.new_group([1, 2, 3], backend="gloo")
        out = {}
        for name, g, gg, members in (("a", a, ga, [0, 1]), ("b", b, gb, [1, 2, 3])):
            if r not in members:
                continue
            out[name + " type"] = isinstance(g, tpcomm.ProcessGroupTpcomm) and g.size() == len(
                members
            )
            x = torch.arange(10.0) * (r + 1)
            y = x.clone()
            dist.all_reduce(x, group=g)
            dist.all_reduce(y, group=gg)
            out[name + " all_reduce"] = torch.equal(x, y)
            src = members[-1]
            bx = torch.full((3,), float(r))
            dist.broadcast(bx, src, group=g)  # global rank, as torch.distributed wants
            out[name + " broadcast"] = bx.tolist() == [float(src)] * 3
        # the world group still works after the sub-groups
        z = torch.ones(2)
        dist.all_reduce(z)
        out["world"] = z.tolist() == [4.0, 4.0]
        return out
    finally:
        dist.destroy_process_group()


def test_subgroups():
    res = tpcomm.launch(subgroups, 4, args=(free_port(),), timeout=180)
    for r, checks in enumerate(res):
        assert checks and all(checks.values()), (r, checks)
        assert ("a all_reduce" in checks) == (r < 2) and ("b all_reduce" in checks) == (r > 0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def ddp(comm, port):
    gloo = _tpcomm_world(comm, port)
    r = dist.get_rank()
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        finals = []
        for group in (None, gloo):  # tpcomm (the default group), then gloo
            model = DDP(_model(), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(100 + r)
            for _ in range(5):
                x = torch.randn(4, 8, generator=gen)
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            finals.append([p.detach().clone() for p in model.parameters()])
            # Drop the DDP model while `gloo` still holds its group: torch 2.13's
            # Reducer frees its last reference to a ProcessGroupGloo with the GIL
            # held, and ~ProcessGroupGloo joins a worker that may still be freeing
            # a work whose saved thread-local state (the contextvars that backward
            # stashes) needs the GIL: a deadlock seen in CI. Freed from Python,
            # the group's binding lets the GIL go first.
            del model, opt
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*finals))
        moved = any(not torch.equal(a, b) for a, b in zip(finals[0], _model().parameters()))
        return same, moved, finals[0]
    finally:
        dist.destroy_process_group()


def test_ddp_matches_gloo():
    res = tpcomm.launch(ddp, 2, args=(free_port(),), timeout=180)
    for same, moved, _ in res:
        assert same and moved
    assert all(torch.equal(a, b) for a, b in zip(res[0][2], res[1][2]))  # replicas agree


def fallbacks(comm, port):
    _tpcomm_world(comm, port)
    rec = []

    class H(logging.Handler):
        def emit(self, record):
            rec.append(record.getMessage())

    logging.getLogger("tpcomm").addHandler(H())
    r = dist.get_rank()
    try:
        x = torch.ones(3, dtype=torch.float64) * (r + 1)
        dist.all_reduce(x)
        dist.all_reduce(x)  # logged once
        errors = []
        buf = torch.empty(2)
        if r == 0:  # rank 1 receives where rank 0 scatters: it is told so
            dist.scatter(buf, [torch.ones(2), torch.full((2,), 2.0)], src=0)
        else:
            try:
                dist.recv(buf, src=0)
            except tpcomm.CommError as e:
                errors.append(str(e))
        try:
            dist.all_reduce(torch.ones(3 + r))  # sizes differ between ranks
        except ValueError as e:
            errors.append(str(e))
        return x.tolist(), [m for m in rec if "goes to torch.distributed" in m], errors
    finally:
        dist.destroy_process_group()


def test_what_the_engine_lacks_goes_to_gloo_and_errors_are_clear():
    res = tpcomm.launch(fallbacks, 2, args=(free_port(),), timeout=120)
    for r, (x, notes, errors) in enumerate(res):
        assert x == [6.0] * 3
        assert len(notes) == 1 and "float64" in notes[0]
        if r == 1:
            assert "rank 0 is in a scatter, not a send" in errors.pop(0)
        assert len(errors) == 1 and "all_reduce" in errors[0]


def from_any_source(comm, port):
    """dist.recv / irecv without src at world 3: rank 0 takes each message from
    whoever sent it, and is told who (as gloo tells)."""
    _tpcomm_world(comm, port)
    r = dist.get_rank()
    try:
        got = []
        if r == 0:
            for _ in range(4):
                t = torch.empty(3)
                src = dist.recv(t)
                got.append((src, t.tolist()))
            t = torch.empty(3)
            work = dist.irecv(t)
            work.wait()
            got.append((work._source_rank(), t.tolist()))
        else:
            for i in range(2):
                dist.send(torch.full((3,), 10.0 * r + i), dst=0)
            if r == 2:
                dist.send(torch.full((3,), 99.0), dst=0)
        dist.barrier()
        return got
    finally:
        dist.destroy_process_group()


def test_recv_without_a_source_takes_the_first_message_of_any_rank():
    got = tpcomm.launch(from_any_source, 3, args=(free_port(),), timeout=120)[0]
    by_src = {1: [], 2: []}
    for src, values in got:
        assert values == [values[0]] * 3
        by_src[src].append(values[0])
    # every message once, each sender's in the order it sent them
    assert by_src == {1: [10.0, 11.0], 2: [20.0, 21.0, 99.0]}


def _spawned(rank, world, port, q):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("tpcomm", rank=rank, world_size=world)  # the whole group
    try:
        x = torch.full((100,), float(rank + 1))
        dist.all_reduce(x)
        parts = [torch.empty(2) for _ in range(world)]
        dist.all_gather(parts, torch.full((2,), float(rank)))
        q.put((rank, dist.get_backend(), x[0].item(), [p[0].item() for p in parts]))
    finally:
        dist.destroy_process_group()


def test_mp_spawn_with_backend_tpcomm():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world = 3
    mp.start_processes(
        _spawned, args=(world, free_port(), q), nprocs=world, join=True, start_method="spawn"
    )
    got = sorted(q.get() for _ in range(world))
    assert got == [(r, "tpcomm", 6.0, [0.0, 1.0, 2.0]) for r in range(world)]


TORCHRUN_SCRIPT = """
import sys
import torch, torch.distributed as dist
import tpcomm  # registers the backend
dist.init_process_group("cpu:tpcomm")
r, w = dist.get_rank(), dist.get_world_size()
x = torch.arange(4, dtype=torch.float32) * (r + 1)
y = x.clone()
dist.all_reduce(x)
g = dist.new_group(backend="gloo")
dist.all_reduce(y, group=g)
assert isinstance(dist.group.WORLD, tpcomm.ProcessGroupTpcomm)
assert torch.equal(x, y), (x, y)
# one write per rank: the ranks share stdout, and print() writes each argument apart
sys.stdout.write(f"rank {r} of {w} ok {x.tolist()}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_torchrun(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("ok [0.0, 3.0, 6.0, 9.0]") == 2, r.stdout


def backend_across_hosts(comm, port):
    import os

    os.environ["TPCOMM_HOST_ID"] = "a" if comm.rank in (0, 2) else "b"
    gloo = _tpcomm_world(comm, port)
    r = dist.get_rank()
    try:
        pg = dist.group.WORLD
        x = torch.randn(1000, generator=torch.Generator().manual_seed(r))
        y = x.double()
        dist.all_reduce(x)
        dist.all_reduce(y, group=gloo)
        parts = [torch.empty(3) for _ in range(4)]
        dist.all_gather(parts, torch.full((3,), float(r)))
        b = torch.full((2,), float(r))
        dist.broadcast(b, 3)
        sc = torch.zeros(2)
        dist.scatter(sc, [torch.full((2,), 10.0 + q) for q in range(4)] if r == 1 else None, src=1)
        b = b if sc.tolist() == [10.0 + r] * 2 else None
        # a batch around the ring of 8 MiB each (gloo's Works there: asynchronous)
        big, into = torch.full((1 << 21,), float(r)), torch.zeros(1 << 21)
        ops = [dist.P2POp(dist.isend, big, (r + 1) % 4), dist.P2POp(dist.irecv, into, (r - 1) % 4)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return (
            pg.communicator._hier is not None,
            torch.allclose(x.double(), y, rtol=1e-5, atol=1e-5),
            [p[0].item() for p in parts],
            b.tolist(),
            bool((into == float((r - 1) % 4)).all()),
        )
    finally:
        dist.destroy_process_group()


def test_backend_on_a_group_spanning_hosts():
    res = tpcomm.launch(backend_across_hosts, 4, args=(free_port(),), timeout=180)
    for hier, close, gathered, b, ring in res:
        assert hier and close and gathered == [0.0, 1.0, 2.0, 3.0] and b == [3.0, 3.0] and ring


def _peer_dies_in_dist_all_reduce(comm, port, outdir):
    import json
    import os
    import time

    _tpcomm_world(comm, port)
    r = dist.get_rank()
    x = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(x)
    if r == 1:
        os._exit(3)  # dies between two collectives, holding nothing
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        res = ["no error", 0.0]
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.monotonic() - t0]
    with open(os.path.join(outdir, f"rank{r}"), "w") as f:
        json.dump(res, f)
    return res


def test_dead_peer_under_dist_all_reduce_raises_peer_failed(tmp_path):
    import json

    from tpcomm.launch import LocalGroup

    with LocalGroup(3, timeout=60) as g, pytest.raises(tpcomm.LaunchError):
        g.run(_peer_dies_in_dist_all_reduce, free_port(), str(tmp_path), timeout=90)
    for r in (0, 2):
        peer, took = json.loads((tmp_path / f"rank{r}").read_text())
        assert peer == 1 and took < SLACK_S, (r, peer, took)


def shut_down(comm, port):
    _tpcomm_world(comm, port)
    pg = dist.group.WORLD
    x = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    dist.destroy_process_group()
    # the private groups are dropped at once, not left to the cycle collector
    released = pg._gloo is None and pg._fallback.group is None and pg._comm.closed
    pg.shutdown()  # idempotent
    try:
        pg.send([torch.ones(1)], 1 - comm.rank, 1)  # tag != 0: the private gloo group
        err = "no error"
    except tpcomm.CommError as e:
        err = str(e)
    return x.tolist(), released, err


def test_destroy_process_group_frees_private_groups():
    for x, released, err in tpcomm.launch(shut_down, 2, args=(free_port(),), timeout=120):
        assert x == [3.0] * 4 and released
        assert "shut down" in err


def p2p_batches(comm, port):
    """isend/irecv as pipeline parallelism uses them: batch_isend_irecv with
    messages far larger than a channel's ring, in both directions and around a
    ring of ranks, in any order inside the batch; isend, a collective, then
    wait; a recv whose shape differs but whose element count agrees (gloo takes
    it); a recv of the wrong dtype (ValueError for that recv only, the channel
    stays in step)."""
    _tpcomm_world(comm, port)
    r, w = dist.get_rank(), dist.get_world_size()
    nxt, prv = (r + 1) % w, (r - 1) % w
    big = 1 << 20  # 4 MiB of float32 each way: several times the ring
    out = {}
    try:
        for order in ("send first", "recv first"):
            x = torch.arange(big, dtype=torch.float32) + 1000 * r
            y = torch.zeros(big)
            ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]
            for req in dist.batch_isend_irecv(ops if order == "send first" else ops[::-1]):
                req.wait()
            out[f"ring {order}"] = torch.equal(
                y, torch.arange(big, dtype=torch.float32) + 1000 * prv
            )
        # both ways with one neighbour, several tensors and dtypes, in one batch
        a = torch.full((big,), r, dtype=torch.int64)
        b = torch.arange(7, dtype=torch.bfloat16) * (r + 1)
        ra, rb = torch.zeros(big, dtype=torch.int64), torch.zeros(7, dtype=torch.bfloat16)
        ops = [
            dist.P2POp(dist.irecv, ra, prv),
            dist.P2POp(dist.isend, a, nxt),
            dist.P2POp(dist.isend, b, nxt),
            dist.P2POp(dist.irecv, rb, prv),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        out["several"] = bool((ra == prv).all()) and torch.equal(
            rb, torch.arange(7, dtype=torch.bfloat16) * (prv + 1)
        )
        # isend, a collective, then wait: the send runs before the collective
        s = torch.full((5,), float(r))
        got = torch.zeros(5)
        reqs = [dist.isend(s, nxt), dist.irecv(got, prv)]
        z = torch.ones(3)
        dist.all_reduce(z)
        for req in reqs:
            req.wait()
        out["isend, all_reduce, wait"] = (
            z.tolist() == [float(w)] * 3 and got.tolist() == [float(prv)] * 5
        )
        # a large isend, then a collective of another tpcomm group that the receiver
        # joins only after its blocking recv: the send must go out first
        other = dist.new_group(list(range(w)))
        z2 = torch.ones(2)
        if r == 0:
            req = dist.isend(torch.full((big,), 5.0), 1)
            dist.all_reduce(z2, group=other)
            req.wait()
            out["isend, other group"] = z2.tolist() == [float(w)] * 2
        else:
            if r == 1:
                into_big = torch.zeros(big)
                dist.recv(into_big, 0)
                out["isend, other group"] = bool((into_big == 5.0).all())
            dist.all_reduce(z2, group=other)
        # same element count, another shape: accepted, as with gloo
        m = torch.arange(12.0).reshape(3, 4) + r
        into = torch.zeros(12)
        for req in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, m, nxt), dist.P2POp(dist.irecv, into, prv)]
        ):
            req.wait()
        out["reshaped"] = torch.equal(into, torch.arange(12.0) + prv)
        # nine dims: the sender's header is pickled, not the binary one expected
        nine = (torch.arange(512.0) + r).reshape((2,) * 9)
        flat = torch.zeros(512)
        for req in dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, flat, prv), dist.P2POp(dist.isend, nine, nxt)]
        ):
            req.wait()
        out["nine dims"] = torch.equal(flat, torch.arange(512.0) + prv)
        # the wrong dtype: that recv raises, nothing written; the channel stays in step
        wrong = torch.full((4,), -1, dtype=torch.int32)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(4), nxt), dist.P2POp(dist.irecv, wrong, prv)]
        )
        try:
            for req in reqs:
                req.wait()
            out["wrong dtype"] = "no error"
        except ValueError as e:
            out["wrong dtype"] = str(e)
        out["untouched"] = wrong.tolist() == [-1] * 4
        after = torch.zeros(2)
        for req in dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((2,), 9.0 + r), nxt),
                dist.P2POp(dist.irecv, after, prv),
            ]
        ):
            req.wait()
        out["in step"] = after.tolist() == [9.0 + prv] * 2
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_batch_isend_irecv_cannot_deadlock(world):
    res = tpcomm.launch(p2p_batches, world, args=(free_port(),), timeout=120)
    for out in res:
        err = out.pop("wrong dtype")
        assert "float32" in err and "int32" in err, err
        assert all(out.values()), out


def late_look_at_a_sent_message(comm, port):
    """Rank 1 waits in a recv; rank 0 sends, then goes into a collective before
    rank 1 has looked again.  Rank 1's next check sees rank 0 ahead in the
    collectives, but its message is there: that is not a crossed call.  (The
    fault knob holds rank 1 100 ms between its last look and its verdicts, the
    window a preempted rank gets on a busy machine.)"""
    _tpcomm_world(comm, port)
    r = dist.get_rank()
    try:
        got = None
        if r == 1:
            _testing.fault_check_delay(dist.group.WORLD._comm, 100_000.0)
            buf = torch.zeros(4)
            dist.recv(buf, src=0)
            got = buf.tolist()
        else:
            time.sleep(0.03)  # rank 1 is inside its first check by now
            dist.send(torch.full((4,), 7.0), 1)
        x = torch.ones(3)
        dist.all_reduce(x)
        return got, x.tolist()
    finally:
        dist.destroy_process_group()


def test_a_message_sent_before_a_collective_is_not_a_crossed_call():
    res = tpcomm.launch(late_look_at_a_sent_message, 2, args=(free_port(),), timeout=60)
    assert res == [(None, [2.0] * 3), ([7.0] * 4, [2.0] * 3)]


def waits_past_tpcomm_timeout(comm, port):
    _tpcomm_world(comm, port)
    try:
        if dist.get_rank() == 1:
            time.sleep(6.0)  # never joins the all_reduce in time
            return None
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            return "no error", time.monotonic() - t0
        except dist.DistBackendError as e:  # torch's type, as callers catch it
            assert isinstance(e, tpcomm.CommTimeoutError) and e.rank == 1, repr(e)
            return str(e), time.monotonic() - t0
    finally:
        dist.destroy_process_group()


def test_tpcomm_timeout_applies_to_the_backend(monkeypatch):
    """The group's timeout is 30 min by default; TPCOMM_TIMEOUT, when set, wins."""
    monkeypatch.setenv("TPCOMM_TIMEOUT", "2")
    msg, waited = tpcomm.launch(waits_past_tpcomm_timeout, 2, args=(free_port(),), timeout=120)[0]
    assert "Timed out after 2s: rank 0 waited for rank 1" in msg, msg
    assert 1.5 < waited < 2.0 + SLACK_S, waited


def _shape_of(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return [_shape_of(x) for x in v]
    return v


def works_beside_gloo(comm, port):
    """Every async collective on cpu:tpcomm and on gloo, same calls: what
    wait(), result(), get_future() and is_completed() give (as shapes)."""
    gloo = _tpcomm_world(comm, port)
    r, w = dist.get_rank(), dist.get_world_size()

    def calls(g):
        z = torch.zeros
        return {
            "all_reduce": lambda: dist.all_reduce(torch.ones(2), group=g, async_op=True),
            "broadcast": lambda: dist.broadcast(torch.ones(2), 0, group=g, async_op=True),
            "reduce": lambda: dist.reduce(torch.ones(2), 0, group=g, async_op=True),
            "all_gather": lambda: dist.all_gather(
                [z(2) for _ in range(w)], torch.ones(2), group=g, async_op=True
            ),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
                z(2 * w), torch.ones(2), group=g, async_op=True
            ),
            "gather": lambda: dist.gather(
                torch.ones(2),
                [z(2) for _ in range(w)] if r == 0 else None,
                0,
                group=g,
                async_op=True,
            ),  # fmt: skip
            "scatter": lambda: dist.scatter(
                z(2),
                [torch.ones(2) for _ in range(w)] if r == 0 else None,
                0,
                group=g,
                async_op=True,
            ),  # fmt: skip
            "all_to_all_single": lambda: dist.all_to_all_single(
                z(2 * w), torch.ones(2 * w), group=g, async_op=True
            ),
            "all_to_all": lambda: dist.all_to_all(
                [z(2) for _ in range(w)],
                [torch.ones(2) for _ in range(w)],
                group=g,
                async_op=True,
            ),  # fmt: skip
            "barrier": lambda: dist.barrier(group=g, async_op=True),
        }

    def seen(make):
        work = make()
        return [
            work.wait(),
            _shape_of(work.result()),
            _shape_of(work.get_future().wait()),
            work.is_completed(),
        ]

    try:
        mine = {name: seen(make) for name, make in calls(None).items()}
        theirs = {name: seen(make) for name, make in calls(gloo).items()}
        wrong = []  # outputs of another shape (same numel): refused by both
        for g in (None, gloo):
            try:
                dist.all_gather([torch.zeros(2, 2) for _ in range(w)], torch.ones(4), group=g)
                wrong.append("no error")
            except (ValueError, RuntimeError) as e:
                wrong.append(type(e).__name__)
        dist.barrier()
        return mine, theirs, wrong
    finally:
        dist.destroy_process_group()


def test_works_and_results_are_gloos():
    for mine, theirs, wrong in tpcomm.launch(
        works_beside_gloo, 4, args=(free_port(),), timeout=180
    ):
        assert mine == theirs
        assert wrong == ["ValueError", "RuntimeError"]


def _call_sites() -> list:
    """Every ``<group>.<method>(...)`` call in torch.distributed's own
    distributed_c10d.py whose method the tpcomm ProcessGroup defines: (method,
    positional argument count, keyword names, line)."""
    import ast
    import inspect

    import torch.distributed.distributed_c10d as c10d

    tree = ast.parse(inspect.getsource(c10d))
    ours = {n for n, v in vars(tpcomm.ProcessGroupTpcomm).items() if callable(v) and n[0] != "_"}
    sites = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ours
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and all(k.arg is not None for k in node.keywords)
        ):
            keys = tuple(k.arg for k in node.keywords)
            sites.append((node.func.attr, len(node.args), keys, node.lineno))
    return sites


def test_the_process_group_takes_every_argument_torch_passes():
    """torch.distributed calls a ProcessGroup's methods with positional and
    keyword arguments of its own choosing (monitored_barrier(timeout,
    wait_all_ranks=...) raised TypeError here): every call site in torch's
    distributed_c10d.py binds to the tpcomm ProcessGroup's method."""
    import inspect

    sites = _call_sites()
    names = {m for m, *_ in sites}
    assert {"monitored_barrier", "allreduce", "barrier", "send", "recv_anysource"} <= names
    problems = []
    for method, npos, keys, line in sites:
        sig = inspect.signature(getattr(tpcomm.ProcessGroupTpcomm, method))
        try:
            sig.bind(None, *([None] * npos), **dict.fromkeys(keys))
        except TypeError as e:
            problems.append(f"distributed_c10d.py:{line} {method}({npos} args, {keys}): {e}")
    assert problems == []


def _monitored(comm, port):
    init_dist(comm, port, "cpu:tpcomm")
    try:
        pg = dist.group.WORLD  # dist.monitored_barrier itself admits gloo groups only
        pg.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks=True)
        pg.monitored_barrier()
        return "ok"
    finally:
        dist.destroy_process_group()


def test_monitored_barrier_as_torch_calls_it():
    """The form distributed_c10d.monitored_barrier uses: (timeout,
    wait_all_ranks=...), served by the private gloo group."""
    assert tpcomm.launch(_monitored, 2, args=(free_port(),), timeout=120) == ["ok", "ok"]

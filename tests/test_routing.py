"""routing.route: which path a call takes, in the documented order.

Guards: one function decides for every collective (the Communicator and
``tpcomm doctor`` both ask it); world size 1 stays local; CUDA tensors go to
the CUDA path; what the engine does not reduce goes to torch.distributed with
the reason; a group spanning hosts is hierarchical for the calls it serves and
torch.distributed for the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpcomm import ReduceOp
from tpcomm.routing import Call, plan, route

ONE_HOST, TWO_HOSTS, ALONE = plan(4), plan(4, 2, "the group spans 2 hosts (a, b)"), plan(1)


@pytest.mark.parametrize(
    "call, one_host, two_hosts",
    [
        (Call("all_reduce", dtype=torch.bfloat16, op=ReduceOp.AVG), "shm", "hier"),
        (Call("reduce_scatter", dtype=torch.int64, op=ReduceOp.MAX), "shm", "hier"),
        (Call("all_reduce", dtype=torch.float64, op=ReduceOp.SUM), "dist", "dist"),
        (Call("all_reduce", dtype=torch.float32, op=dist.ReduceOp.PRODUCT), "dist", "dist"),
        (Call("all_reduce", cuda=True), "cuda", "cuda"),
        (Call("all_gather"), "shm", "hier"),
        (Call("all_gather", even=False), "shm", "dist"),
        (Call("gather", rooted=True), "shm", "dist"),
        (Call("broadcast"), "shm", "hier"),
        (Call("barrier"), "shm", "hier"),
        (Call("all_to_all"), "shm", "dist"),
        (Call("p2p"), "shm", "dist"),
    ],
)
def test_the_documented_order(call, one_host, two_hosts):
    assert route(ONE_HOST, call).path == one_host
    assert route(TWO_HOSTS, call).path == two_hosts
    assert route(ALONE, call).path == "local"


def test_reasons_name_what_the_engine_lacks():
    r = route(ONE_HOST, Call("all_reduce", dtype=torch.complex64, op=ReduceOp.SUM))
    assert r.path == "dist" and "unsupported dtype torch.complex64" in r.reason
    r = route(TWO_HOSTS, Call("all_reduce", dtype=torch.float32, op=dist.ReduceOp.BAND))
    assert r.path == "dist" and "op BAND is not supported" in r.reason
    r = route(TWO_HOSTS, Call("p2p"))
    assert r.reason == "the group spans 2 hosts (a, b)"
    assert route(ONE_HOST, Call("all_reduce", dtype=torch.float16, op=ReduceOp.MIN)).reason == ""


def test_real_paths_have_the_same_predicates():
    """The Communicator routes over its real paths (ShmPath, DistPath, ...);
    doctor over plan()'s stand-ins: both must decide alike."""
    from tpcomm.dist_path import DistPath
    from tpcomm.shm.path import ShmPath

    calls = [
        Call("all_reduce", dtype=torch.float64, op=ReduceOp.SUM),
        Call("all_reduce", dtype=torch.int32, op=dist.ReduceOp.PRODUCT),
        Call("reduce_scatter", dtype=torch.bfloat16, op=ReduceOp.AVG),
        Call("gather", rooted=True),
        Call("p2p"),
    ]
    for call in calls:
        assert ShmPath.should_use(call) == ONE_HOST[1].should_use(call)
        assert DistPath.should_use(call) is None and ONE_HOST[2].should_use(call) is None
    assert [p.name for p in ONE_HOST] == ["cuda", ShmPath.name, DistPath.name]


# (what routing is asked, the real call that asks it); the call's tensors are
# the same on every rank, so its result is known
def _real_calls(comm):
    w, other = comm.world_size, 1 - comm.rank
    f64, c64, i64 = torch.float64, torch.complex64, torch.int64
    prod = dist.ReduceOp.PRODUCT
    return [
        (Call("all_reduce", dtype=torch.float32, op=ReduceOp.SUM),
         lambda: comm.all_reduce(torch.ones(8))),
        (Call("all_reduce", dtype=f64, op=ReduceOp.SUM),
         lambda: comm.all_reduce(torch.ones(8, dtype=f64))),
        (Call("all_reduce", dtype=torch.float32, op=prod),
         lambda: comm.all_reduce(torch.ones(8), prod)),
        (Call("reduce_scatter", dtype=i64, op=ReduceOp.MAX),
         lambda: comm.reduce_scatter(torch.ones(2 * w, dtype=i64), op=ReduceOp.MAX)),
        (Call("reduce_scatter", dtype=c64, op=ReduceOp.SUM),
         lambda: comm.reduce_scatter(torch.ones(2 * w, dtype=c64))),
        (Call("all_gather"), lambda: comm.all_gather(torch.ones(3, 2), dim=1)),
        (Call("all_gather", even=False),
         lambda: comm.all_gatherv(torch.ones(2 + comm.rank), [2 + q for q in range(w)])),
        (Call("gather", rooted=True), lambda: comm.gather(torch.ones(3, 2), dst=0, dim=1)),
        (Call("broadcast"), lambda: comm.broadcast(torch.ones(5).t(), src=1)),
        (Call("barrier"), lambda: comm.barrier()),
        (Call("all_to_all"),
         lambda: comm.all_to_all_single(torch.empty(2 * w, 3)[:, :2], torch.ones(2 * w, 2))),
        (Call("p2p"), lambda: comm.sendrecv([torch.ones(2)[::2]], other, other)),
    ]  # fmt: skip


def _observed_paths(comm):
    """Which path each real call took: shared memory when it ran collective
    rounds, torch.distributed when it logged so (a reason is logged once per
    communicator: a dup() of the pool's, whose earlier calls logged theirs);
    then again, each call's route now kept from the first time, by rounds
    alone (torch.distributed runs none); and whether closing let go of the
    kept routes (they hold the paths)."""
    with comm.dup() as fresh:
        first = _observed(fresh)
        again = _observed(fresh, by_rounds=True)
    return first, again, fresh._routes == {}


def _observed(comm, by_rounds=False):
    import logging

    from tpcomm import _testing

    seen: list = []

    class Notes(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("tpcomm")
    handler = Notes()
    log.addHandler(handler)
    out = []
    try:
        for call, run in _real_calls(comm):
            before, notes = _testing.rounds(comm), len(seen)
            run()
            comm.barrier()  # counted: one round
            # point-to-point has channels of its own, not rounds: not told is shm
            shm = _testing.rounds(comm) - before > 1 or call.kind == "p2p"
            told = any("goes to torch.distributed" in m for m in seen[notes:])
            if by_rounds:
                told = call.kind != "p2p" and not shm
            out.append((call.kind, "dist" if told else "shm" if shm else "?"))
    finally:
        log.removeHandler(handler)
    return out


def test_decisions_are_what_real_calls_do(pools):
    """route()'s decision for each kind of call (over plan()'s stand-ins, what
    tpcomm doctor prints) is the path a real call of that kind takes on a
    real communicator: shared-memory rounds, or torch.distributed with its
    reason logged."""
    got = pools.run(2, _observed_paths)
    want = [(call.kind, route(plan(2), call).path) for call, _ in _real_calls(_Shape(2))]
    assert got == [(want, want, True)] * 2


class _Shape:
    """Enough of a Communicator to build the case list outside the ranks."""

    def __init__(self, world):
        self.world_size, self.rank = world, 0

    def __getattr__(self, name):
        return None

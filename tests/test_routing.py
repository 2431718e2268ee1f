"""routing.route: which path a call takes, in the documented order.

Guards: one function decides for every collective, over the real paths'
own ``should_use`` (LocalPath, CudaPath, ShmPath, Hierarchy, DistPath);
``tpcomm doctor``'s stand-ins (``plan``) decide alike; world size 1 stays
local; CUDA tensors go to the CUDA path; what the engine does not reduce
goes to torch.distributed with the reason; a group spanning hosts is
hierarchical for the calls it serves (Hierarchy.should_use) and
torch.distributed for the rest; the torch.distributed backend's own choices
(``backend_way``); and real calls on a real communicator reach the path
route() names, observed on the paths themselves with nothing forced.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpcomm import ReduceOp
from tpcomm.cuda.path import CudaPath
from tpcomm.dist_path import DistPath
from tpcomm.hierarchical import Hierarchy
from tpcomm.paths import LOCAL, NOT_PLAIN, Path
from tpcomm.routing import Call, backend_way, order, plan, route
from tpcomm.shm.path import ShmPath


def _hierarchy(members):
    """A Hierarchy's routing face without a group: its hosts' ranks."""
    h = Hierarchy.__new__(Hierarchy)
    h.members, h.hosts = members, len(members)
    return h


def _shm():
    return ShmPath.__new__(ShmPath)  # should_use reads nothing of the engine


# the real paths of a group of 4 on one host, on two hosts, and of one rank
CUDA = CudaPath(None, lambda: None)
DIST = DistPath(None, 0, 4)
ONE_HOST = order(4, CUDA, _shm(), DIST)
TWO_HOSTS = order(4, CUDA, _hierarchy([[0, 1], [2, 3]]), DIST)
ALONE = order(1, CUDA, None, None)
WHY_HOSTS = "the group spans 2 hosts (host 0: ranks [0, 1]; host 1: ranks [2, 3])"

CASES = [
    (Call("all_reduce", dtype=torch.bfloat16, op=ReduceOp.AVG), "shm", "hier"),
    (Call("reduce_scatter", dtype=torch.int64, op=ReduceOp.MAX), "shm", "hier"),
    (Call("all_reduce", dtype=torch.float64, op=ReduceOp.SUM), "dist", "dist"),
    (Call("all_reduce", dtype=torch.float32, op=dist.ReduceOp.PRODUCT), "dist", "dist"),
    (Call("all_reduce", sparse=True, op=ReduceOp.SUM), "dist", "dist"),
    (Call("all_reduce", cuda=True), "cuda", "cuda"),
    (Call("all_gather", cuda=True), "shm", "hier"),  # the CUDA path objects: CPU code decides
    (Call("all_gather"), "shm", "hier"),
    (Call("all_gather", even=False), "shm", "dist"),
    (Call("gather", rooted=True), "shm", "dist"),
    (Call("broadcast"), "shm", "hier"),
    (Call("barrier"), "shm", "hier"),
    (Call("empty"), "shm", "hier"),
    (Call("all_to_all"), "shm", "dist"),
    (Call("p2p"), "shm", "dist"),
]


@pytest.mark.parametrize("call, one_host, two_hosts", CASES)
def test_the_documented_order_over_the_real_paths(call, one_host, two_hosts):
    assert route(ONE_HOST, call).path == one_host
    assert route(TWO_HOSTS, call).path == two_hosts
    assert route(ALONE, call).path == "local"
    assert route(ALONE, call).via is LOCAL


@pytest.mark.parametrize("call, one_host, two_hosts", CASES)
def test_doctors_stand_ins_decide_as_the_real_paths(call, one_host, two_hosts):
    assert route(plan(4), call)[:2] == route(ONE_HOST, call)[:2]
    assert route(plan(4, 2, WHY_HOSTS), call)[:2] == route(TWO_HOSTS, call)[:2]
    assert route(plan(1), call).path == "local"


def test_reasons_name_what_the_engine_lacks():
    r = route(ONE_HOST, Call("all_reduce", dtype=torch.complex64, op=ReduceOp.SUM))
    assert r.path == "dist" and "unsupported dtype torch.complex64" in r.reason
    r = route(TWO_HOSTS, Call("all_reduce", dtype=torch.float32, op=dist.ReduceOp.BAND))
    assert r.path == "dist" and "op BAND is not supported" in r.reason
    assert route(TWO_HOSTS, Call("p2p")).reason == WHY_HOSTS
    assert route(TWO_HOSTS, Call("all_to_all")).reason == WHY_HOSTS
    assert "sparse" in route(ONE_HOST, Call("all_reduce", sparse=True)).reason
    assert route(ONE_HOST, Call("all_reduce", dtype=torch.float16, op=ReduceOp.MIN)).reason == ""


def test_a_hierarchy_objects_to_what_it_cannot_serve():
    h = _hierarchy([[0, 2], [1]])
    for call in (Call("all_to_all"), Call("p2p"), Call("gather", rooted=True)):
        assert (
            h.should_use(call)
            == "the group spans 2 hosts (host 0: ranks [0, 2]; host 1: ranks [1])"
        )
    with pytest.raises(AssertionError, match="routing sends all_to_all"):
        h.all_to_all("all_to_all_single", torch.empty(2), torch.empty(2), [], [])


@pytest.mark.parametrize(
    "call, kw, way",
    [
        (Call("allreduce_coalesced", cuda=True), {}, "nccl"),
        (Call("broadcast", cuda=True), {}, "nccl"),
        (Call("alltoall_base", cuda=True), {}, "nccl"),
        (Call("p2p", cuda=True), {}, "nccl"),
        (Call("all_reduce", cuda=True), {}, "comm"),  # the CUDA path takes it
        (Call("broadcast"), {}, "comm"),
        (Call("p2p"), {}, "comm"),
        (Call("p2p"), {"tag": 3}, "gloo"),
        (Call("p2p"), {"shared_memory": False}, "gloo"),
        (Call("all_to_all"), {"same_shapes": False}, "gloo"),
        (Call("all_to_all"), {}, "comm"),
        (Call("monitored_barrier"), {}, "gloo"),
    ],
)
def test_the_backends_ways(call, kw, way):
    assert backend_way(call, **kw) == way


# the real calls, and what routing is asked for each; the tensors are the same
# on every rank
def _real_calls(comm):
    w, other = comm.world_size, 1 - comm.rank
    f64, c64, i64 = torch.float64, torch.complex64, torch.int64
    prod = dist.ReduceOp.PRODUCT
    sparse = torch.ones(4).to_sparse()
    return [
        (Call("all_reduce", dtype=torch.float32, op=ReduceOp.SUM),
         lambda: comm.all_reduce(torch.ones(8))),
        (Call("all_reduce", dtype=f64, op=ReduceOp.SUM),
         lambda: comm.all_reduce(torch.ones(8, dtype=f64))),
        (Call("all_reduce", dtype=torch.float32, op=prod),
         lambda: comm.all_reduce(torch.ones(8), prod)),
        (Call("all_reduce", sparse=True, op=ReduceOp.SUM), lambda: comm.all_reduce(sparse)),
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
        (Call("p2p"), lambda: comm.sendrecv([torch.ones(2)], other, other)),
        (Call("p2p"), lambda: comm.scatter(torch.empty(2), [torch.ones(2)] * w, src=0)),
    ]  # fmt: skip


_INTERFACE = [n for n, v in vars(Path).items() if callable(v) and not n.startswith("_")]


def _spy(path, seen):
    """Record the path's name each time one of its Path methods takes a call
    (a one-call entry: when it did the call); the call itself is unchanged."""

    def wrap(name, f):
        def run(*a, **k):
            got = f(*a, **k)
            if not name.startswith("fast_") or (got is not None and got is not NOT_PLAIN):
                seen.append(path.name)
            return got

        return run

    for name in _INTERFACE:
        if name != "should_use":
            setattr(path, name, wrap(name, getattr(path, name)))


def _observed(comm):
    """Which path each real call reached, on a dup() of the pool's
    communicator whose every path records what it takes; the one-call
    all_reduce (a C entry on the Communicator) counts as shared memory's when
    it needed no other path."""
    with comm.dup() as fresh:
        seen: list = []
        for path in {id(p): p for p in [*fresh._paths, fresh._fast]}.values():
            _spy(path, seen)
        out = []
        for _, run in _real_calls(fresh):
            del seen[:]
            run()
            took = [n for n in seen if n not in ("cuda",)]
            out.append(took[0] if took else "shm (C entry)")
            fresh.barrier()
        return out, fresh._routes != {}


def test_real_calls_reach_the_path_route_names(pools):
    """Each real call, on a real two-rank communicator of one host, reaches
    the path route() names for what it asks: observed on the paths (nothing
    forced), so the decisions doctor prints are what calls do."""
    paths = order(2, CUDA, _shm(), DIST)
    want = [route(paths, call).path for call, _ in _real_calls(_Shape(2))]
    for got, kept in pools.run(2, _observed):
        assert kept  # the routes were kept per Call
        assert [g if g != "shm (C entry)" else "shm" for g in got] == want, got


class _Shape:
    """Enough of a Communicator to build the case list outside the ranks."""

    def __init__(self, world):
        self.world_size, self.rank = world, 0

    def __getattr__(self, name):
        return None

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

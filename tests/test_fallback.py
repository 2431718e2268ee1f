"""The torch.distributed path: never silent, never wrong.

A group that spans hosts (simulated with TPCOMM_HOST_ID) sends what the
hierarchy does not cover (gather, uneven all_gather, point-to-point) to
torch.distributed; a dtype or op the engine lacks (float64, complex, PRODUCT, int8)
goes there per call.  Results are compared with gloo on the same data; each reason
is logged once.  Without a torch.distributed group, a private gloo group over the
set-up store does the same (world size 1 takes the local path).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import tpcomm

from ._helpers import free_port, init_dist


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _gloo_world_logged(comm, port):
    """A gloo world, and the records of tpcomm's log from here on."""
    init_dist(comm, port)
    rec = _Records()
    logging.getLogger("tpcomm").addHandler(rec)
    return rec


def _gloo_all_gather(x, dim=0):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def across_hosts(comm, port):
    os.environ["TPCOMM_HOST_ID"] = "host-a" if comm.rank < 2 else "host-b"
    rec = _gloo_world_logged(comm, port)
    r, w = comm.rank, comm.world_size
    checks = {}
    try:
        with tpcomm.Communicator() as c:
            x = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
            for op, dop in (
                (tpcomm.ReduceOp.SUM, dist.ReduceOp.SUM),
                (tpcomm.ReduceOp.MAX, dist.ReduceOp.MAX),
            ):
                a, b = x.clone(), x.clone()
                c.all_reduce(a, op)
                dist.all_reduce(b, op=dop)
                checks[f"all_reduce {op.name}"] = torch.equal(a, b)
            a = x.clone()
            c.all_reduce(a, tpcomm.ReduceOp.AVG)
            checks["all_reduce AVG"] = torch.equal(
                a, sum(x / (r + 1) * (q + 1) for q in range(w)) / w
            )
            checks["all_gather dim1"] = torch.equal(c.all_gather(x, dim=1), _gloo_all_gather(x, 1))
            sizes = [q % 3 for q in range(w)]
            v = c.all_gatherv(torch.full((sizes[r], 2), r), sizes)
            checks["all_gatherv"] = v.tolist() == [
                [q, q] for q in range(w) for _ in range(sizes[q])
            ]
            g = c.gather(x, dst=1)
            everyone = _gloo_all_gather(x)  # collective: called on every rank
            checks["gather"] = torch.equal(g, everyone) if r == 1 else g is None
            o = torch.empty_like(everyone) if r == 1 else None
            g = c.gather(x, dst=1, out=o)
            checks["gather out="] = g is o and torch.equal(o, everyone) if r == 1 else g is None
            rs = c.reduce_scatter(torch.ones(w * 2, 3) * (r + 1))
            checks["reduce_scatter"] = torch.equal(
                rs, torch.full((2, 3), float(sum(range(1, w + 1))))
            )
            bc = torch.full((5,), float(r))
            c.broadcast(bc, src=3)
            checks["broadcast"] = bc.tolist() == [3.0] * 5
            if r == 0:
                c.send([torch.arange(4), torch.tensor(True)], dst=3)
                c.send_tensor_dict({"t": torch.ones(2), "n": 5}, dst=3)
            if r == 3:
                got = c.recv(src=0)
                d = c.recv_tensor_dict(src=0)
                checks["send/recv"] = got[0].tolist() == [0, 1, 2, 3] and bool(got[1])
                checks["dicts"] = d["t"].tolist() == [1.0, 1.0] and d["n"] == 5
            c.barrier()
        notes = [m for m in rec.messages if "spans 2 hosts" in m]
        return checks, len(notes), len({m.split(" goes to")[0] for m in notes})
    finally:
        dist.destroy_process_group()


def test_group_spanning_hosts_goes_to_torch_distributed():
    res = tpcomm.launch(across_hosts, 4, args=(free_port(),), timeout=120)
    for checks, n_notes, n_fns in res:
        assert checks and all(checks.values()), checks
        assert n_notes == n_fns  # one line per collective, not per call


def unsupported_on_one_host(comm, port):
    rec = _gloo_world_logged(comm, port)
    r, w = comm.rank, comm.world_size
    checks = {}
    try:
        c = tpcomm.Communicator()
        assert c.shared_memory  # one host: shared memory for the rest
        for dtype in (torch.float64, torch.complex64):
            a = (torch.arange(6) + r).to(dtype)
            b = a.clone()
            c.all_reduce(a)
            c.all_reduce(a.clone())  # a second call logs nothing new
            dist.all_reduce(b)
            checks[f"sum {dtype}"] = torch.equal(a, b)
        a = torch.full((4,), float(r + 2))
        b = a.clone()
        c.all_reduce(a, dist.ReduceOp.PRODUCT)
        dist.all_reduce(b, op=dist.ReduceOp.PRODUCT)
        checks["PRODUCT"] = torch.equal(a, b)
        rs = c.reduce_scatter(torch.ones(w * 3, dtype=torch.int8) * (r + 1))
        checks["reduce_scatter int8"] = rs.tolist() == [sum(range(1, w + 1))] * 3
        # the engine still does what it can
        e = torch.ones(3)
        c.all_reduce(e)
        checks["float32 on the engine"] = e.tolist() == [float(w)] * 3
        c.close()
        return checks, rec.messages
    finally:
        dist.destroy_process_group()


def test_unsupported_dtypes_and_ops_fall_back_and_say_why():
    res = tpcomm.launch(unsupported_on_one_host, 3, args=(free_port(),), timeout=120)
    for checks, messages in res:
        assert all(checks.values()), checks
        reasons = [m for m in messages if "goes to torch.distributed" in m]
        assert len(reasons) == 4, reasons  # float64, complex64, PRODUCT, int8: once each
        assert any("float64" in m for m in reasons) and any("PRODUCT" in m for m in reasons)


def world_one_local(comm):
    z = torch.tensor([1 + 2j, 3 - 1j])
    comm.all_reduce(z)
    y = torch.arange(4, dtype=torch.float64)
    return z.tolist(), comm.reduce_scatter(y).tolist(), comm.all_gather(y).tolist()


def test_world_size_one_is_local(pools):
    z, rs, ag = pools.run(1, world_one_local)[0]
    assert z == [1 + 2j, 3 - 1j] and rs == [0.0, 1.0, 2.0, 3.0] and ag == rs


def _without_group(comm):
    z = torch.arange(3, dtype=torch.float64) * (comm.rank + 1)
    comm.all_reduce(z)
    p = torch.full((2,), 2.0 + comm.rank)
    comm.all_reduce(p, dist.ReduceOp.PRODUCT)
    return z.tolist(), p.tolist()


def test_without_a_group_a_private_gloo_group_falls_back(pools):
    """launch/from_env communicators have no torch.distributed group: the engine makes
    a gloo group of its own over the set-up store, on first use."""
    for z, p in pools.run(3, _without_group):
        assert z == [0.0, 6.0, 12.0] and p == [24.0, 24.0]

"""Groups that span hosts (simulated with TPCOMM_HOST_ID): shared memory inside
each host, gloo between the host leaders.  Every result is compared with a flat
gloo run of the same call on the same data, and must be bitwise identical on
every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tpcomm

from ._helpers import free_port, torchrun_env

# rank -> host; the second layout has hosts of 2, 2 and 1 ranks, not consecutive
LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "3 hosts": ["a", "b", "a", "c", "b"],
}


def _gloo_all_gather(x, dim=0):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def _close(a, b, dtype):
    if dtype.is_floating_point:
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    return torch.equal(a, b)


def hierarchical(comm, port, hosts):
    os.environ["TPCOMM_HOST_ID"] = hosts[comm.rank]
    r, w = comm.rank, comm.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w)
    checks, bits = {}, []
    try:
        with tpcomm.Communicator(timeout=30) as c:
            h = c._hier
            checks["hierarchy"] = h is not None and h.hosts == len(set(hosts))
            checks["properties"] = c.spans_hosts and not c.shared_memory and not c.single_copy
            gen = torch.Generator().manual_seed(100 + r)
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
                for op in ("SUM", "MAX", "MIN", "AVG"):
                    if op == "AVG" and not dtype.is_floating_point:
                        continue
                    if dtype.is_floating_point:
                        x = torch.randn(3, 1000, generator=gen).to(dtype)
                    else:
                        x = torch.randint(-1000, 1000, (3, 1000), generator=gen)
                    a = x.clone()
                    c.all_reduce(a, getattr(tpcomm.ReduceOp, op))
                    b = x.double() if dtype.is_floating_point else x.clone()
                    dist.all_reduce(
                        b, op=dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op)
                    )
                    if op == "AVG":
                        b /= w
                    checks[f"all_reduce {dtype} {op}"] = _close(a, b.to(dtype), dtype)
                    bits.append(a)
            # non-contiguous input, all_reduce of a slice
            x = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, ::2] * (r + 1)
            y = x.contiguous()
            c.all_reduce(x)
            dist.all_reduce(y)
            checks["all_reduce strided"] = torch.equal(x, y)
            for dim in (0, 1):
                x = torch.randn(2, 3, generator=gen) + r
                g = c.all_gather(x, dim=dim)
                checks[f"all_gather dim{dim}"] = torch.equal(g, _gloo_all_gather(x, dim))
                bits.append(g)
            x = torch.arange(6, dtype=torch.int32) + 10 * r
            out = torch.empty(6 * w, dtype=torch.int32)
            c.all_gather_into_tensor(out, x)
            checks["all_gather_into_tensor"] = torch.equal(out, _gloo_all_gather(x))
            x = torch.randn(w * 2, 5, generator=gen)
            rs = c.reduce_scatter(x)
            full = x.double()
            dist.all_reduce(full)
            checks["reduce_scatter"] = _close(rs, full[2 * r : 2 * r + 2].float(), torch.float32)
            o = torch.empty(5)
            c.reduce_scatter_tensor(o, torch.arange(5.0 * w) * (r + 1))
            checks["reduce_scatter_tensor"] = o.tolist() == [
                float(5 * r + k) * sum(range(1, w + 1)) for k in range(5)
            ]
            for src in range(w):
                bc = torch.full((7,), float(r)) if r != src else torch.arange(7.0) + src
                c.broadcast(bc, src=src)
                checks[f"broadcast from {src}"] = bc.tolist() == (torch.arange(7.0) + src).tolist()
            c.barrier()
            # the flat torch.distributed path still carries the rest
            g = c.gather(torch.tensor([r]), dst=w - 1)
            checks["gather"] = g.tolist() == list(range(w)) if r == w - 1 else g is None
            # all_to_all_single across hosts (the gathered fallback), uneven
            sends = [[(q + j) % 3 for j in range(w)] for q in range(w)]
            xs = [torch.arange(sum(sends[q]), dtype=torch.float32) + 100 * q for q in range(w)]
            want = torch.cat([xs[q][sum(sends[q][:r]) : sum(sends[q][: r + 1])] for q in range(w)])
            out = torch.empty(len(want))
            c.all_to_all_single(out, xs[r], [sends[q][r] for q in range(w)], sends[r])
            checks["all_to_all_single"] = torch.equal(out, want)
            # bad splits there: the same verdict and words as in shared memory
            ins = [2 if (r == 0 and q == 1) else 1 for q in range(w)]
            outs = [3 if (r == 1 and q == 0) else 1 for q in range(w)]
            try:
                c.all_to_all_single(torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins)
                said = "no error"
            except ValueError as e:
                said = str(e)
            checks["all_to_all_single bad splits"] = (
                said == "all_to_all_single: rank 0 sends 2 rows to rank 1, which expects 3 from it"
            )
            # a ring shift of 8 MiB: every rank sends before it receives
            big = torch.full((1 << 21,), float(r))
            (got,) = c.sendrecv([big], (r + 1) % w, (r - 1) % w)
            checks["sendrecv ring"] = bool((got == float((r - 1) % w)).all())
        return checks, [t.view(torch.uint8).flatten() if t.dtype != torch.bool else t for t in bits]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_matches_flat_gloo(layout):
    hosts = LAYOUTS[layout]
    res = tpcomm.launch(hierarchical, len(hosts), args=(free_port(), hosts), timeout=180)
    for checks, _ in res:
        assert all(checks.values()), {k: v for k, v in checks.items() if not v}
    first = res[0][1]
    for _, bits in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, bits))  # same bits everywhere


def from_env_across_hosts(comm, port):
    torchrun_env(comm, port, TPCOMM_HOST_ID=f"host-{comm.rank // 2}")
    with tpcomm.Communicator.from_env(timeout=30) as c:
        x = torch.full((4,), float(c.rank + 1))
        c.all_reduce(x)
        g = c.all_gather(torch.tensor([c.rank]))
        z = torch.ones(3, dtype=torch.float64) * c.rank  # the flat gloo path
        c.all_reduce(z)
        return x.tolist(), g.tolist(), z.tolist(), c._hier.hosts


def test_from_env_across_hosts_needs_no_torch_distributed():
    """No torch.distributed group: the leaders' gloo group is made over the set-up store."""
    res = tpcomm.launch(from_env_across_hosts, 4, args=(free_port(),), timeout=120)
    for x, g, z, hosts in res:
        assert x == [10.0] * 4 and g == [0, 1, 2, 3] and z == [6.0] * 3 and hosts == 2


def leader_dies(comm, port, outdir):
    import json
    import time

    os.environ["TPCOMM_HOST_ID"] = "a" if comm.rank < 2 else "b"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=4
    )
    c = tpcomm.Communicator(timeout=60)
    x = torch.ones(100)
    c.all_reduce(x)
    if comm.rank == 2:  # the leader of host b
        os._exit(3)
    t0 = time.monotonic()
    try:
        c.all_reduce(x)
        res = ["no error", 0.0, ""]
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.monotonic() - t0, str(e)]
    with open(os.path.join(outdir, f"rank{comm.rank}"), "w") as f:
        json.dump(res, f)
    return res


def test_a_dead_leader_fails_every_host_fast(tmp_path):
    """Rank 2, leader of host b, dies: its host peer (rank 3) sees it through shared
    memory; the other leader sees gloo fail and aborts its own host, so rank 1
    does not wait out the timeout."""
    import json

    from tpcomm.launch import LocalGroup

    with LocalGroup(4, timeout=60) as g, pytest.raises(tpcomm.LaunchError):
        g.run(leader_dies, free_port(), str(tmp_path), timeout=90)
    got = {r: json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1, 3)}
    assert got[3][0] == 2 and "rank 2" in got[3][2], got  # global rank, not local 0
    assert got[0][0] == -1 and "between the host leaders" in got[0][2], got
    assert got[1][0] == 0, got  # its leader aborted the host
    assert all(took < 10.0 for _, took, _ in got.values()), got

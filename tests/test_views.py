"""Tensors whose memory holds other values than they show.

``x.conj()`` (complex) and negative views (``torch._neg_view(x)``, or
``x.conj().imag``) are contiguous, but their memory holds the values before
the pending conjugation or negation. The engine moves raw memory, so each
collective must resolve them on the way in and write through them on the
way out. Odd ranks pass such views, even ranks plain tensors; every result
is compared with torch on one process, computed from every rank's values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import ReduceOp

from ._helpers import free_port
from ._ref import digest, make, reference


def _view(base: torch.Tensor, odd: bool) -> torch.Tensor:
    """A conj (complex) or negative (real) view on odd ranks, ``base`` itself on even ones."""
    if not odd:
        return base
    return base.conj() if base.is_complex() else torch._neg_view(base)


def _values(r: int, shape, dtype, seed: int) -> torch.Tensor:
    """What rank r's input shows (resolved), computed on any rank."""
    return _view(make(r, shape, dtype, seed), r % 2 == 1).resolve_conj().resolve_neg()


def _input(r: int, shape, dtype, seed: int) -> torch.Tensor:
    v = _view(make(r, shape, dtype, seed), r % 2 == 1)
    assert v.is_contiguous() and (v.is_neg() or v.is_conj()) == (r % 2 == 1)
    return v


def collectives(comm):
    r, w = comm.rank, comm.world_size
    odd = r % 2 == 1
    checks = {}

    def same(name, got, want):
        checks[name] = bool(
            got.dtype == want.dtype and torch.equal(got.resolve_conj().resolve_neg(), want)
        )

    for dt in (torch.float32, torch.bfloat16):
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            x = _input(r, 37, dt, 1)
            out = comm.all_reduce(x, op)
            want = reference([_values(k, 37, dt, 1) for k in range(w)], op)
            same(f"all_reduce {dt} {op.name}", out, want)
            checks[f"all_reduce {dt} {op.name} is x, still a view"] = out is x and x.is_neg() == odd

    # complex all_reduce goes to torch.distributed: the conj view must be resolved there too
    z = _input(r, 9, torch.complex64, 2)
    comm.all_reduce(z)
    want = sum(_values(k, 9, torch.complex64, 2).to(torch.complex128) for k in range(w))
    checks["all_reduce complex64 (fallback)"] = bool(
        torch.allclose(z.resolve_conj().to(torch.complex128), want, atol=1e-5)
    )

    for dt in (torch.float32, torch.complex64):
        for d in (0, 1):
            x = _input(r, (4, 6), dt, 3)
            got = comm.all_gather(x, dim=d)
            same(
                f"all_gather {dt} dim {d}",
                got,
                torch.cat([_values(k, (4, 6), dt, 3) for k in range(w)], d),
            )
        x = _input(r, (4, 6), dt, 4)
        got = comm.gather(x, dst=w - 1)
        if r == w - 1:
            same(f"gather {dt}", got, torch.cat([_values(k, (4, 6), dt, 4) for k in range(w)]))

        # output a view on odd ranks too
        buf = _view(torch.zeros(w * 24, dtype=dt), odd)
        comm.all_gather_into_tensor(buf, _input(r, (4, 6), dt, 5))
        same(
            f"all_gather_into_tensor {dt}",
            buf,
            torch.cat([_values(k, 24, dt, 5) for k in range(w)]),
        )

        t = _input(r, 11, dt, 6) if r == 0 else _view(torch.zeros(11, dtype=dt), odd)
        comm.broadcast(t, src=0)
        same(f"broadcast {dt}", t, _values(0, 11, dt, 6))

    x = _input(r, (w * 3, 5), torch.float32, 7)
    got = comm.reduce_scatter(x)
    full = reference([_values(k, (w * 3, 5), torch.float32, 7) for k in range(w)], ReduceOp.SUM)
    same("reduce_scatter", got, full[r * 3 : (r + 1) * 3])
    out = _view(torch.zeros(15), odd)
    comm.reduce_scatter_tensor(out, _input(r, (w * 3, 5), torch.float32, 7))
    same("reduce_scatter_tensor", out, full[r * 3 : (r + 1) * 3].reshape(-1))

    # point to point: a ring, each message holding a conj and a negative view
    nxt, prv = (r + 1) % w, (r - 1) % w
    msg = [_input(1, 5, torch.complex64, 8 + r), _input(1, (2, 3), torch.float32, 9 + r)]
    if r == 0:
        comm.send(msg, nxt)
        got = comm.recv(prv)
    else:
        got = comm.recv(prv)
        comm.send(msg, nxt)
    same("p2p conj", got[0], _values(1, 5, torch.complex64, 8 + prv))
    same("p2p neg", got[1], _values(1, (2, 3), torch.float32, 9 + prv))

    # a view cannot be received into (its memory would hold other values): a clear error
    if r == 0:
        comm.send([torch.ones(3, dtype=torch.complex64)], nxt)
    if r == 1:
        try:
            comm.recv(0, out=[torch.zeros(3, dtype=torch.complex64).conj()])
            checks["recv into a conj view raises"] = False
        except ValueError as e:
            checks["recv into a conj view raises"] = "not dense" in str(e)
        # refused before receiving: the message is still there
        checks["then received"] = torch.equal(comm.recv(0)[0], torch.ones(3, dtype=torch.complex64))
    comm.barrier()
    return checks, digest(comm.all_reduce(_input(r, 64, torch.bfloat16, 10)).resolve_neg())


@pytest.mark.parametrize("world", [2, 3])
def test_conj_and_negative_views(pools, world):
    res = pools.run(world, collectives)
    for checks, _ in res:
        assert checks and all(checks.values()), [k for k, v in checks.items() if not v]
    assert len({d for _, d in res}) == 1  # bitwise the same on every rank


def backend(comm, port):
    dist.init_process_group(
        "cpu:tpcomm",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.world_size,
    )
    r, w = dist.get_rank(), dist.get_world_size()
    odd = r % 2 == 1
    checks = {}
    try:
        x = _input(r, 8, torch.float32, 11)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        want = reference([_values(k, 8, torch.float32, 11) for k in range(w)], ReduceOp.MAX)
        checks["all_reduce"] = torch.equal(x.resolve_neg(), want)
        t = (
            _input(r, 6, torch.float32, 12)
            if r == 0
            else _view(torch.zeros(6, dtype=torch.float32), odd)
        )
        dist.broadcast(t, src=0)
        checks["broadcast"] = torch.equal(t.resolve_neg(), _values(0, 6, torch.float32, 12))
        if r == 0:
            dist.send(_input(1, 4, torch.float32, 13), dst=1)
        elif r == 1:
            buf = torch._neg_view(
                torch.zeros(4)
            )  # received into through the view (torch.distributed refuses conj views itself)
            dist.recv(buf, src=0)
            checks["recv into a negative view"] = torch.equal(
                buf.resolve_neg(), _values(1, 4, torch.float32, 13)
            )
        return checks
    finally:
        dist.destroy_process_group()


def test_views_through_the_backend():
    res = tpcomm.launch(backend, 2, args=(free_port(),), timeout=120)
    for checks in res:
        assert checks and all(checks.values()), [k for k, v in checks.items() if not v]

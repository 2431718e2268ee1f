"""The public API's smaller parts, each directly: the properties that say where
a communicator's collectives run, try_send, from_store, peer_buffers, the
launcher's free_port.

Guards: README's API table; each of these was reached only through other
calls before.
"""

from __future__ import annotations

import importlib
import socket

import pytest
import torch

import tpcomm
from tpcomm import _testing

from ._helpers import free_port


def _properties(comm):
    eng = _testing.engine(comm)
    return (
        comm.shared_memory,
        comm.spans_hosts,
        comm.single_copy,
        eng is not None and comm.single_copy == eng.cma,
    )


@pytest.mark.parametrize("world", [1, 2])
def test_properties_say_where_calls_run(pools, world):
    for shm, hosts, single, agrees in pools.run(world, _properties):
        assert shm == (world > 1) and hosts is False
        assert single is (agrees if world > 1 else False)
        assert agrees == (world > 1)


def _try_send(comm):
    if comm.rank == 0:
        small = comm.try_send([torch.arange(4.0)], dst=1)
        big = comm.try_send([torch.ones(8 << 20)], dst=1)  # more than the ring holds
        comm.send([torch.tensor([7.0])], dst=1)
        return small, big
    first = comm.recv(0)[0].tolist()
    second = comm.recv(0)[0].tolist()  # the big one was never sent
    return first, second


def test_try_send_sends_only_what_fits_now(pools):
    (small, big), (first, second) = pools.run(2, _try_send)
    assert small is True and big is False
    assert first == [0.0, 1.0, 2.0, 3.0] and second == [7.0]


def _alone(comm):
    return comm.try_send([torch.ones(2)], dst=0)


def test_try_send_without_shared_memory_sends_nothing(pools):
    assert pools.run(1, _alone) == [False]


def _over_a_store(comm, port):
    from torch.distributed import TCPStore

    r, w = comm.rank, comm.world_size
    store = TCPStore("127.0.0.1", port, w, is_master=r == 0, wait_for_workers=False)
    a = tpcomm.Communicator.from_store(store, r, w, prefix="a", timeout=60)
    b = tpcomm.Communicator.from_store(store, r, w, prefix="b", timeout=60)
    try:
        x = a.all_reduce(torch.full((3,), float(r + 1)))
        y = b.all_gather(torch.tensor([r]))
        return a.rank, a.world_size, a.shared_memory, x.tolist(), y.tolist()
    finally:
        a.close()
        b.close()
        comm.barrier()  # the store's host (rank 0) stays until every rank is done


def test_from_store_makes_communicators_apart_by_prefix():
    res = tpcomm.launch(_over_a_store, 3, args=(free_port(),), timeout=120)
    for r, (rank, world, shm, x, y) in enumerate(res):
        assert (rank, world, shm) == (r, 3, True)
        assert x == [6.0] * 3 and y == [0, 1, 2]


def test_free_port_is_free_and_out_of_the_kernels_way(monkeypatch):
    launch = importlib.import_module("tpcomm.launch")  # the module (tpcomm.launch is the function)
    lo, _hi = launch._ephemeral_ports()
    held = []
    try:
        for _ in range(20):  # each one free while the ones before are held
            port = free_port()
            if lo > 1024 + 64:
                assert port < lo  # never one the kernel hands out by itself
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
        assert len({s.getsockname()[1] for s in held}) == 20
    finally:
        for s in held:
            s.close()
    # no room below the range: the kernel's pick, still free
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (1024, 60999))
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _peer_buffers(comm):
    t = comm.empty((4,), torch.float32)
    t.fill_(comm.rank + 1)
    comm.barrier()
    views = comm.peer_buffers(t)
    seen = [v[:16].view(torch.float32).tolist() for v in views]
    errors = []
    for bad in ([1, 2], torch.ones(4), torch.ones(4, device="meta")):
        try:
            comm.peer_buffers(bad)
            errors.append("no error")
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    comm.barrier()
    return seen, errors


def test_peer_buffers_and_their_errors(pools):
    for seen, errors in pools.run(2, _peer_buffers):
        assert seen == [[1.0] * 4, [2.0] * 4]
        assert errors[0].startswith("TypeError: peer_buffers: tensor must be a torch.Tensor")
        assert errors[1].startswith("ValueError: peer_buffers: the tensor is not in a buffer")
        assert errors[2].startswith("ValueError: peer_buffers: tensor must be a CPU tensor")

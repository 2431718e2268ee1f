"""Rendezvous: how the ranks of a communicator find each other and the segment.

Everything goes through a torch ``Store`` (the torch.distributed group's, a
TCPStore from the environment, or the launcher's), under a key prefix that is
unique per communicator.  The store is used only during set-up: after it,
the ranks talk through shared memory alone (rank 0, which hosts a TCPStore,
may be the one that dies).
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any

from . import _env
from .errors import CommError, CommTimeoutError

__all__ = ["host_identity", "exchange", "broadcast_from_rank0", "master_store"]


def master_store(host: str, port: int, world: Any, timeout: float) -> Any:
    """The TCPStore a rank hosts for the set-up, listening on ``host`` only
    (torch's own listens on every interface: anyone who reaches the port could
    write set-up keys).  Falls back to torch's when ``host`` is not an address
    of this machine (the store is then reachable as before)."""
    import errno

    from torch.distributed import TCPStore

    fd = None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1024)
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()  # the store owns it from here on (and closes it)
    except OSError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise
    return TCPStore(
        host,
        port,
        world,
        is_master=True,
        timeout=_env.timedelta(timeout),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "no-boot-id"


def host_identity() -> str:
    """Who counts as 'the same host': hostname + boot id, or TPCOMM_HOST_ID."""
    override = _env.host_id_override()
    if override:
        return override
    return f"{socket.gethostname()}/{_boot_id()}"


def _wait(store: Any, keys: list[str], timeout: float, what: str) -> None:
    try:
        store.wait(keys, _env.timedelta(timeout))
    except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
        raise CommTimeoutError(
            f"tpcomm: rendezvous timed out after {timeout:g}s waiting for {what} ({e})"
        ) from None


def exchange(
    store: Any, prefix: str, rank: int, world: int, name: str, value: str, timeout: float
) -> list[str]:
    """Every rank publishes ``value``; returns all ranks' values in rank order.

    Rank 0 returns only after every rank has read them all: under
    ``from_env`` it hosts the store, and a rank 0 that raised right away (the
    ranks span hosts, say) would take the store down under the others' reads.
    """
    store.set(f"{prefix}/{name}/{rank}", value)
    keys = [f"{prefix}/{name}/{r}" for r in range(world)]
    _wait(store, keys, timeout, f"every rank's {name}")
    values = [store.get(k).decode() for k in keys]
    done = f"{prefix}/{name}/read"
    count = store.add(done, 1)
    if rank == 0:
        deadline = time.monotonic() + timeout
        while count < world:
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"tpcomm: rendezvous timed out after {timeout:g}s "
                    f"waiting for every rank to read the {name}s"
                )
            time.sleep(0.001)
            count = store.add(done, 0)
    return values


def broadcast_from_rank0(
    store: Any, prefix: str, rank: int, name: str, value: str | None, timeout: float
) -> str:
    """Rank 0 publishes ``value``; every rank returns it.

    A value starting with ``!`` is an error rank 0 hit during set-up; the
    other ranks raise it too instead of waiting for a segment that will never
    come.
    """
    key = f"{prefix}/{name}"
    if rank == 0:
        assert value is not None
        store.set(key, value)
    else:
        _wait(store, [key], timeout, f"rank 0's {name}")
        value = store.get(key).decode()
    if value.startswith("!"):
        raise CommError(value[1:] if rank == 0 else f"rank 0 failed to set up: {value[1:]}")
    return value


def local_cpu_count() -> int:
    """CPUs this process may run on (affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
